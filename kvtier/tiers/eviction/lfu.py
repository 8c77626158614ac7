"""``lfu``: least frequently used first, and among keys used as often, least
recently used first; just enough to fit. A key counts one use when it comes
in and one more on each touch. For tiers whose working set is a few hot
prefixes (system prompts) that bursts of one-off requests would push out
under LRU. Counts live in the process: the disk tier starts each key at one
use after a restart (in its access log's recency order), and the tiers many
processes share, which see only recency stamps, cannot run it.

Buckets of keys by count, each in recency order, keep every change O(1)."""

from __future__ import annotations

from kvtier.tiers.eviction.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._count: dict = {}  # key -> uses
        self._buckets: dict[int, dict] = {}  # uses -> its keys, least recently used first

    def _admitted(self, key) -> None:
        self._count[key] = 1
        self._buckets.setdefault(1, {})[key] = None

    def _used_again(self, key) -> None:
        n = self._unbucket(key)
        self._count[key] = n + 1
        self._buckets.setdefault(n + 1, {})[key] = None

    def _dropped(self, key) -> None:
        self._unbucket(key)
        del self._count[key]

    def _unbucket(self, key) -> int:
        n = self._count[key]
        bucket = self._buckets[n]
        del bucket[key]
        if not bucket:
            del self._buckets[n]
        return n

    def __iter__(self):
        for n in sorted(self._buckets):
            yield from self._buckets[n]
