"""Host DRAM tier: byte capacity, an eviction policy (LRU by default),
objects pinned while read.

All state sits behind one lock, held only for bookkeeping, never across a
copy. The tier holds one reference to each object it keeps (``retain`` on
insert, ``release`` on eviction), so evicted buffers return to the pool once
no write-through job or reader still holds them. ``fetch`` pins the entries it yields; eviction skips pinned entries, and
a store that cannot make room without evicting a pinned one is refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

from kvtier.codec import ChunkObject
from kvtier.configfields import opt, size_field
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.eviction import EvictionPolicy, check, make


@dataclass(frozen=True)
class MemoryConfig:
    capacity: int = size_field(0, "bytes of host DRAM for chunks (required)")
    name: str = opt("memory", "tier name in metrics and logs")
    eviction: str = opt("lru", "eviction policy: lru or lfu")

    def validate(self, prefix: str = "") -> None:
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set for the memory tier", "set it, e.g. capacity: 8GiB")
        check(self.eviction, self, f"{prefix}eviction")


class _Entry:
    __slots__ = ("obj", "pins")

    def __init__(self, obj: ChunkObject):
        self.obj = obj
        self.pins = 0


class MemoryTier(Tier):
    kind = "memory"
    Config = MemoryConfig
    persistent = False
    host_memory = True
    keeps_buffers = True

    def __init__(self, config: MemoryConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        # digest -> entry, walked in eviction order (``config.eviction``).
        self._entries: EvictionPolicy[bytes, _Entry] = make(config.eviction, config)

    def _get(self, key: ChunkKey) -> _Entry | None:
        e = self._entries.get(key.digest)
        if e is None:
            return None
        if not e.obj.header.matches(key):
            # Same name, other chunk (a naming-digest collision): a miss,
            # counted like a failed check in the persistent tiers. The entry
            # stays: it is the rightful object of its own key.
            self.metrics.corrupt()
            return None
        return e

    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int:
        with self._lock:
            for i, k in enumerate(keys):
                if self._get(k) is None:
                    return i
            return len(keys)

    def fetch(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> Iterator[ChunkObject]:
        pinned: list[_Entry] = []
        with self._lock:
            for k in keys:
                e = self._get(k)
                if e is None:
                    break
                e.pins += 1
                self._entries.touch(k.digest)
                pinned.append(e)
        self.metrics.miss(len(keys) - len(pinned))
        try:
            for e in pinned:
                yield e.obj
                self.metrics.hit(1, e.obj.header.num_tokens, e.obj.nbytes)
        finally:
            with self._lock:
                for e in pinned:
                    e.pins -= 1

    def store(self, objs: Sequence[ChunkObject]) -> int:
        for n, obj in enumerate(objs):
            if not self._put(obj):
                self.metrics.dropped("capacity", len(objs) - n)
                return n
        return len(objs)

    def _put(self, obj: ChunkObject) -> bool:
        size = obj.nbytes
        if size > self.capacity:
            return False
        evicted = 0
        with self._lock:
            old = self._entries.get(obj.header.key)
            if old is not None and old.obj.header == obj.header:
                self._entries.touch(obj.header.key)
                self.metrics.skipped()
                return True
            if old is not None:  # a colliding or stale entry: replace it unless in use
                if old.pins:
                    return False
                self._remove(obj.header.key)
            entries = self._entries
            victims = entries.victims(entries.to_free(entries.used, size), self._unpinned)
            if entries.used - sum(entries.size(d) for d in victims) + size > self.capacity:
                return False  # pinned entries leave no room
            for digest in victims:
                self._remove(digest)
                evicted += 1
            entries.insert(obj.header.key, size, _Entry(obj.retain()))
            used = entries.used
        if evicted:
            self.metrics.evicted(evicted)
            self._removed(victims)
        self.metrics.wrote(size)
        self.metrics.used(used)
        return True

    def _unpinned(self, digest: bytes) -> bool:
        return self._entries.get(digest).pins == 0

    def _remove(self, digest: bytes) -> None:
        # Caller holds the lock and has checked that the entry is not pinned.
        e = self._entries.get(digest)
        self._entries.remove(digest)
        e.obj.release()

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        gone = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k.digest)
                if e is not None and e.pins == 0:
                    self._remove(k.digest)
                    gone.append(k.digest)
            used = self._entries.used
        self.metrics.used(used)
        self._removed(gone)
        return len(gone)

    def done_with(self, obj: ChunkObject) -> None:
        """Nothing to release: ``fetch`` lends the tier's own reference,
        the entry pinned until the fetch moves on (or ends)."""

    def drop_cache(self) -> int:
        return 0  # no files: the entries are the cache

    def clear(self) -> int:
        """Drop every unpinned entry; returns how many."""
        with self._lock:
            victims = [d for d in self._entries if self._unpinned(d)]
            for d in victims:
                self._remove(d)
            used = self._entries.used
        self.metrics.used(used)
        self._removed(victims)
        return len(victims)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, len(self._entries), self._entries.used, self.capacity)

    def close(self) -> None:
        with self._lock:
            for digest in [d for d in self._entries if self._unpinned(d)]:
                self._remove(digest)
