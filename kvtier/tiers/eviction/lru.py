"""``lru``: least recently used first, just enough to fit. The memory and
disk tiers' default."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.tiers.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"
    ranks_by_recency = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._held = OrderedDict()  # least recently used first: the order is the map's own

    def _used_again(self, key) -> None:
        self._held.move_to_end(key)

    def __iter__(self):
        return iter(self._held)
