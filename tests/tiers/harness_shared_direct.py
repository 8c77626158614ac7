"""The shared directory tier read with O_DIRECT through native AIO
(``o_direct: true, aio: true``: one driver thread per load, ``AioStream``)
in the contract suite: the same contract as the buffered shared tier, on
the other read path."""

from __future__ import annotations

from kvtier.tiers.shared import SharedTier
from tests.support import shared_config
from tests.tiers.harness import SharedHarness


class SharedDirectHarness(SharedHarness):
    kind = "shared-direct"
    tier_kind = "shared"

    def _open(self, capacity):
        return SharedTier(shared_config(self.path, capacity, name=self.name, touch_interval_s=0.0, o_direct=True, aio=True),
                          self.metrics)


HARNESS = SharedDirectHarness
