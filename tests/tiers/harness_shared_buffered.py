"""The shared directory tier read buffered with readahead (``o_direct:
false``: one pool thread per object, 128 KiB pieces) in the contract suite:
the same contract as the default shared tier (O_DIRECT through native AIO),
on the other read path."""

from __future__ import annotations

from kvtier.tiers.shared import SharedTier
from tests.support import shared_config
from tests.tiers.harness import SharedHarness


class SharedBufferedHarness(SharedHarness):
    kind = "shared-buffered"
    tier_kind = "shared"

    def _open(self, capacity):
        return SharedTier(shared_config(self.path, capacity, name=self.name, touch_interval_s=0.0, o_direct=False),
                          self.metrics)


HARNESS = SharedBufferedHarness
