"""The node memory tier (``shm``) in the contract suite: a fresh directory
on tmpfs per test, removed at the end."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from kvtier.tiers.shm import ShmConfig, ShmTier
from tests.tiers.harness import Harness


class ShmHarness(Harness):
    kind = "shm"

    def __init__(self, tmp_path, metrics):
        super().__init__(tmp_path, metrics)
        self.path = Path(tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm"))

    def _open(self, capacity):
        return ShmTier(ShmConfig(capacity=capacity, path=str(self.path), name=self.name, touch_interval_s=0.0),
                       self.metrics)

    def tick(self):
        # Recency is the file's mtime; tmpfs stamps it from a coarse clock.
        time.sleep(0.012)

    def close_all(self):
        super().close_all()
        shutil.rmtree(self.path, ignore_errors=True)


HARNESS = ShmHarness
