"""Tier kinds from outside kvtier (``tiers/registry.py``): a package that
declares a kind in the ``kvtier.tiers`` entry-point group adds it once
installed; a tier class on the Python path is a kind by its import path. The
example package (``examples/sqlite_tier``) is installed here for real, with
pip, into a folder of its own; the contract suite runs over the same tier
(``harness_sqlite.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import parse_store_config
from kvtier.errors import ConfigError
from tests.support import make_chunks

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sqlite_tier"

# Runs in a fresh interpreter whose path holds the installed package (and
# not the examples folder): what a user's process sees after `pip install`.
_USER = r"""
import json, sys
from kvtier.config import load_config
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers import registry
from tests.support import make_chunks

db = sys.argv[1]
cfg = load_config(environ={"KVTIER_TIERS": f"memory://?capacity=1MiB,sqlite://{db}?capacity=1MiB"},
                  overrides={"chunk_tokens": 16})
metrics = Metrics()
c = make_chunks(4)
with_store = TieredStore(cfg, metrics)
try:
    assert with_store.put(c.objs) == 4
    assert with_store.flush(30)
    with_store.tier("memory").clear()
    bufs = [bytearray(len(p)) for p in c.payloads]
    loaded = with_store.load(c.keys, bufs)
    same = [bytes(b) for b in bufs] == c.payloads
finally:
    with_store.close()
print(json.dumps({
    "kinds": registry.kinds(),
    "module": registry.resolve("sqlite").__module__,
    "file": sys.modules[registry.resolve("sqlite").__module__].__file__,
    "specs": [[t.kind, t.config.name] for t in cfg.tiers],
    "loaded": loaded, "same": same,
    "sqlite_hits": metrics.value("kvtier_hit_chunks_total", tier="sqlite"),
}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``pip install ./examples/sqlite_tier`` into a folder of its own (from a
    copy: pip builds in the source tree)."""
    src = tmp_path_factory.mktemp("src") / "sqlite_tier"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(target), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_an_installed_package_adds_its_tier_kind(site, tmp_path):
    db = tmp_path / "kv.db"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(repo)])}
    proc = subprocess.run([sys.executable, "-c", _USER, str(db)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert "sqlite" in out["kinds"] and "memory" in out["kinds"]
    assert out["module"] == "kvtier_sqlite" and out["file"].startswith(str(site))  # the installed copy
    assert out["specs"] == [["memory", "memory"], ["sqlite", "sqlite"]]
    # Saved through the store, the memory tier emptied: every chunk came back from the plugin's tier.
    assert out["loaded"] == 4 and out["same"] and out["sqlite_hits"] == 4
    assert db.stat().st_size > 0


def test_a_tier_class_by_import_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from kvtier.engine.store import TieredStore

    cfg = parse_store_config({"chunk_tokens": 16, "tiers": [
        {"kind": "kvtier_sqlite:SqliteTier", "path": str(tmp_path / "kv.db"), "capacity": "1MiB"}]})
    assert cfg.tiers[0].config.name == "sqlite"  # the class's kind, not its import path
    c = make_chunks(3)
    store = TieredStore(cfg)
    try:
        assert store.put(c.objs) == 3 and store.flush(30)
        assert store.lookup(c.keys).segments[0].tier == "sqlite"
    finally:
        store.close()


@pytest.mark.parametrize("kind, says", [
    ("floppy", "entry point group kvtier.tiers"),
    ("no_such_module_anywhere:Tier", "cannot import 'no_such_module_anywhere'"),
    ("kvtier.tiers.memory:NoSuchTier", "has no 'NoSuchTier'"),
    ("kvtier.tiers.base:TierStats", "not a kvtier Tier class"),
])
def test_a_kind_that_is_not_a_tier_is_a_config_error(kind, says):
    with pytest.raises(ConfigError) as err:
        parse_store_config({"tiers": [{"kind": kind, "capacity": "1MiB"}]})
    assert err.value.key == "tiers[0].kind" and says in str(err.value)
