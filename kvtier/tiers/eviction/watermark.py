"""``watermark``: least recently used first, in batches. Once usage (with
the bytes a store brings) passes ``high_watermark`` of capacity, evict down
to ``low_watermark`` of it (lower still if the store needs more room), so
that the next stores find room without evicting again. The default of the
tiers many processes share, whose order is rebuilt from recency stamps by a
scan (``base.rank``) that a batch makes rare: shm (no ``high_watermark``
key: evict when a store does not fit) and the collectors of the shared
directory and S3 tiers (a pass once usage passes ``high_watermark``)."""

from __future__ import annotations

import math

from kvtier.tiers.eviction.lru import LRUPolicy


class WatermarkPolicy(LRUPolicy):
    name = "watermark"
    settings = ("low_watermark",)

    def __init__(self, capacity: int, high_watermark: float = 1.0, low_watermark: float = 1.0) -> None:
        super().__init__(capacity)
        self.high_watermark = high_watermark  # fractions of capacity
        self.low_watermark = low_watermark

    @classmethod
    def of(cls, config) -> "WatermarkPolicy":
        return cls(config.capacity, getattr(config, "high_watermark", 1.0), config.low_watermark)

    def to_free(self, used: int, incoming: int = 0) -> int:
        if used + incoming <= self.high_watermark * self.capacity:
            return 0
        target = min(self.capacity - incoming, math.floor(self.low_watermark * self.capacity))
        return max(0, used - target)
