"""Harnesses of the contract suite: how to open each tier kind (again) on
storage that outlives an instance.

A new tier kind joins the suite by adding a module ``tests/tiers/harness_<kind>.py``
that defines ``HARNESS``, a ``Harness`` subclass (start its server in
``__init__`` or a module-level fixture-free helper, stop it in ``close_all``).
Nothing else in the suite names a kind.
"""

from __future__ import annotations

import importlib
import itertools
import time
from pathlib import Path

from kvtier.metrics import Metrics
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.shared import SharedTier
from tests.support import OBJ, disk_config, memory_config, shared_config

CAP = 64 * OBJ
_names = itertools.count()


class Harness:
    """Opens one kind of tier on storage that outlives each instance.
    ``kind`` names the harness; ``tier_kind`` is the kind its tiers report
    (the same, unless the harness runs a kind in another configuration)."""

    kind: str

    @property
    def tier_kind(self) -> str:
        return self.kind

    def __init__(self, tmp_path: Path, metrics: Metrics):
        self.path = tmp_path / self.kind
        self.metrics = metrics
        self.name = f"{self.kind}{next(_names)}"  # unique: thread names and metric labels
        self.opened: list[Tier] = []

    def open(self, capacity: int = CAP) -> Tier:
        tier = self._open(capacity)
        self.opened.append(tier)
        return tier

    def _open(self, capacity: int) -> Tier:
        raise NotImplementedError

    def settle(self, tier: Tier) -> None:
        """Let asynchronous capacity enforcement finish (no-op where it is synchronous)."""

    def tick(self) -> None:
        """Make the next access strictly more recent than the previous one."""

    def close_all(self) -> None:
        for t in self.opened:
            t.close()


class MemoryHarness(Harness):
    kind = "memory"

    def _open(self, capacity):
        return MemoryTier(memory_config(capacity, name=self.name), self.metrics)


class DiskHarness(Harness):
    kind = "disk"

    def _open(self, capacity):
        return DiskTier(disk_config(self.path, capacity, name=self.name), self.metrics)


class SharedHarness(Harness):
    kind = "shared"

    def _open(self, capacity):
        return SharedTier(shared_config(self.path, capacity, name=self.name, touch_interval_s=0.0), self.metrics)

    def settle(self, tier):
        # The shared tier enforces capacity by watermark collection passes
        # (automatic every gc_interval_s, or `kvtier store gc`): run one.
        assert tier.gc().ran

    def tick(self):
        # Recency is the file's mtime; file systems stamp it from a coarse clock.
        time.sleep(0.012)


HARNESSES: dict[str, type[Harness]] = {h.kind: h for h in (MemoryHarness, DiskHarness, SharedHarness)}
for _mod in sorted(Path(__file__).parent.glob("harness_*.py")):
    _h = importlib.import_module(f"tests.tiers.{_mod.stem}").HARNESS
    HARNESSES[_h.kind] = _h
