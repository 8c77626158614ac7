"""`kvtier store ...` against a real shared directory."""

import json
import os
import subprocess
import sys

from kvtier.codec import HEADER_BLOCK, encode
from kvtier.keys import Namespace, chunk_keys
from kvtier.tiers.shared import SharedConfig, SharedTier


def kvtier(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def populate(path, n=6, tokens_per_chunk=16):
    ns = Namespace("m", "fp", "float16", "test", 2, 2, 8, chunk_tokens=tokens_per_chunk)
    keys = chunk_keys(ns, list(range(n * tokens_per_chunk)))
    objs = [encode(k, "float16", (2, 2, 2, k.num_tokens, 8), os.urandom(k.num_tokens * 128)) for k in keys]
    with SharedTier(SharedConfig(path=str(path), capacity=1 << 30, gc_interval_s=0)) as t:
        assert t.store(objs) == n
        paths = [t.dir.path(k) for k in keys]
    return keys, objs, paths


def test_store_stat_ls(tmp_path):
    keys, objs, _ = populate(tmp_path)
    doc = json.loads(kvtier("store", "stat", "--dir", str(tmp_path), "--json").stdout)
    assert doc["objects"] == 6
    assert doc["bytes"] == sum(o.nbytes for o in objs)
    assert len(doc["namespaces"]) == 1
    out = kvtier("store", "ls", "--dir", str(tmp_path)).stdout.splitlines()
    assert sorted(line.split()[1] for line in out) == sorted(k.hex for k in keys)
    human = kvtier("store", "stat", "--dir", str(tmp_path), "--capacity", "1MiB").stdout
    assert "objects      6" in human and "% used" in human


def test_store_verify_finds_and_quarantines_corruption(tmp_path):
    _, _, paths = populate(tmp_path)
    assert "verified 6 objects; 0 bad" in kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress").stdout
    with open(paths[2], "r+b") as f:
        f.seek(HEADER_BLOCK + 5)
        b = f.read(1)
        f.seek(HEADER_BLOCK + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    proc = kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress", check=False)
    assert proc.returncode == 1
    assert "5 objects; 1 bad" in proc.stdout and "checksum" in proc.stdout
    assert not paths[2].exists()
    assert len(list((tmp_path / "kvtier-v1" / "quarantine").iterdir())) == 1


def test_store_gc_collects_least_recently_used(tmp_path):
    _, objs, paths = populate(tmp_path, n=10)
    for i, p in enumerate(paths):  # path i last used at time 1000 + i
        os.utime(p, (1000 + i, 1000 + i))
    size = objs[0].nbytes
    capacity = 8 * size  # usage 10/8 > high watermark; collect to <= 0.5 * 8 = 4 objects
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", str(capacity),
                  "--high-watermark", "0.9", "--low-watermark", "0.5", "--dry-run")
    assert "would delete 6" in proc.stdout and all(p.exists() for p in paths)
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", str(capacity),
                  "--high-watermark", "0.9", "--low-watermark", "0.5")
    assert "deleted 6" in proc.stdout
    assert [p.exists() for p in paths] == [False] * 6 + [True] * 4


def test_store_gc_needs_capacity_and_sane_watermarks(tmp_path):
    proc = kvtier("store", "gc", "--dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and "--capacity" in proc.stderr and "Fix:" in proc.stderr
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", "1GiB", "--low-watermark", "0.99", check=False)
    assert proc.returncode == 2 and "low_watermark" in proc.stderr


def test_unusable_directory_is_a_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    proc = kvtier("store", "stat", "--dir", str(f / "sub"), check=False)
    assert proc.returncode == 2
    assert "not usable" in proc.stderr and "Fix:" in proc.stderr


def test_help_explains_every_command():
    top = kvtier("--help").stdout
    assert "bench" in top and "store" in top
    for sub in (["bench", "storage"], ["store", "gc"], ["store", "verify"], ["store", "stat"], ["store", "ls"]):
        assert "usage: kvtier" in kvtier(*sub, "--help").stdout
