"""The shared directory tier with adaptive reads switching path on every
other load (``ReadPathChooser`` counting loads of any size, exploring every
second load) in the contract suite: loads alternate between O_DIRECT
through native AIO and buffered reads, and the contract holds across the
switches."""

from __future__ import annotations

from kvtier.tiers.dir.readpath import ReadPathChooser
from kvtier.tiers.shared import SharedTier
from tests.support import shared_config
from tests.tiers.harness import SharedHarness


class SharedAdaptiveHarness(SharedHarness):
    kind = "shared-adaptive"
    tier_kind = "shared"

    def _open(self, capacity):
        tier = SharedTier(shared_config(self.path, capacity, name=self.name, touch_interval_s=0.0, adaptive_reads=True),
                          self.metrics)
        tier._paths = ReadPathChooser(explore_every=2, min_bytes=0, warmup=0)
        return tier


HARNESS = SharedAdaptiveHarness
