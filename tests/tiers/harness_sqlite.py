"""A tier from outside kvtier in the contract suite: the SQLite tier of
``examples/sqlite_tier``, opened the way a user's configuration opens it, by
import path through kvtier's registry (``tests/tiers/test_plugin.py`` installs
it and opens it by the kind its entry point declares)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.config import parse_tier
from kvtier.tiers import registry
from tests.tiers.harness import Harness

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sqlite_tier"
if str(EXAMPLE) not in sys.path:
    sys.path.append(str(EXAMPLE))  # as PYTHONPATH=examples/sqlite_tier would


class SqliteHarness(Harness):
    kind = "sqlite"

    def __init__(self, tmp_path, metrics):
        super().__init__(tmp_path, metrics)
        self.path.mkdir(parents=True, exist_ok=True)

    def _open(self, capacity):
        spec = parse_tier({"kind": "kvtier_sqlite:SqliteTier", "path": str(self.path / "kv.db"),
                           "capacity": f"{capacity}B", "name": self.name}, "tiers[0]")
        return registry.resolve(spec.kind)(spec.config, self.metrics)


HARNESS = SqliteHarness
