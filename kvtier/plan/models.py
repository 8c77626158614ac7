"""kvtier's tiers as plain data structures over the tiers' own eviction
policies (``kvtier.tiers.eviction``, by the name a tier's config gives):
no I/O, no threads.

Each model mirrors one real tier's bookkeeping, operation for operation
(``tests/plan/test_models_vs_tiers.py`` replays one access sequence through
both and compares what each holds):

    LRUModel     MemoryTier and DiskTier: byte capacity, the tier's policy
                 (LRU unless given another). A store of a held key only
                 refreshes it; a new key evicts the policy's victims until
                 it fits; an object larger than the whole tier is refused.
                 Reads refresh.
                 (MemoryTier never evicts an entry pinned by a reader; the
                 simulator serves one request at a time, so nothing is
                 pinned when a store runs.)
    SharedModel  SharedTier: objects carry an access stamp (mtime), set on
                 write, on a re-store of a held key, and on a read at most
                 once per ``touch_interval_s``. Collection runs the tier's
                 policy (``watermark`` unless given another: a pass deletes
                 the oldest stamps once usage exceeds the high watermark
                 until it is at most the low one) when the collector's
                 ``due`` says a pass is (first write, every interval, sooner
                 while over).
    EngineModel  vLLM's prefix cache: blocks of a finished request go to the
                 free queue (tail blocks first, so they are evicted first);
                 a new request's blocks are taken from the cold end.

Keys are ints; sizes are bytes (tiers) or blocks (engine).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvtier.tiers.collector import due
from kvtier.tiers.eviction import EvictionPolicy
from kvtier.tiers.eviction.lru import LRUPolicy
from kvtier.tiers.eviction.watermark import WatermarkPolicy


class LRUModel:
    __slots__ = ("capacity", "entries", "evictions", "on_event")

    def __init__(self, capacity: int, on_event: Callable[[int, int], None] | None = None,
                 policy: EvictionPolicy | None = None):
        self.capacity = capacity
        # key -> bytes under the tier's policy (LRU by default), walked first to go first
        self.entries = policy if policy is not None else LRUPolicy(capacity)
        self.evictions = 0
        self.on_event = on_event  # (key, size) on every refresh/insert: the stack-distance stream

    @property
    def used(self) -> int:
        return self.entries.used

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def touch(self, key: int) -> bool:
        if self.entries.touch(key):
            if self.on_event is not None:
                self.on_event(key, self.entries.size(key))
            return True
        return False

    def store(self, key: int, size: int) -> bool:
        if self.touch(key):
            return True
        if size > self.capacity:
            return False
        entries = self.entries
        victims = entries.victims(entries.to_free(entries.used, size))
        for v in victims:
            entries.remove(v)
        self.evictions += len(victims)
        entries.insert(key, size)
        if self.on_event is not None:
            self.on_event(key, size)
        return True


class SharedModel:
    """A shared tier seen by the instances of one simulation (one clock).

    The tier's collector ranks a scan by the files' stamps (``eviction.rank``);
    the model keeps its policy instead and stamps it as the tier stamps its
    files (the policy's value is the stamp): with a clock that never goes
    back, stamping order is the order of the files' mtimes, ties broken the
    way the file system breaks them (the later write is newer), so a pass
    needs no sort. ``policy`` (one that ranks by recency; ``watermark`` by
    default) is the tier's."""

    __slots__ = (
        "capacity",
        "evictions",
        "gc_interval_s",
        "gc_passes",
        "last_gc",
        "on_event",
        "stamps",
        "touch_interval_s",
    )

    def __init__(self, capacity: int, high_watermark: float = 0.95, low_watermark: float = 0.85,
                 touch_interval_s: float = 60.0, gc_interval_s: float = 60.0,
                 on_event: Callable[[int, int], None] | None = None, policy: EvictionPolicy | None = None):
        self.capacity = capacity
        # key -> bytes, with its stamp as the value, oldest stamp first
        self.stamps = policy if policy is not None else WatermarkPolicy(capacity, high_watermark, low_watermark)
        self.touch_interval_s = touch_interval_s
        self.gc_interval_s = gc_interval_s
        self.last_gc: float | None = None
        self.evictions = 0
        self.gc_passes = 0
        self.on_event = on_event  # (key, size) on every store, (key, -1) on every read hit

    @property
    def used(self) -> int:
        return self.stamps.used

    def __contains__(self, key: int) -> bool:
        return key in self.stamps

    def _stamp(self, key: int, now: float) -> None:
        self.stamps.insert(key, self.stamps.size(key), now)

    def read(self, key: int, now: float) -> bool:
        """A hit read: stamps the object if its stamp is old enough."""
        t = self.stamps.get(key)
        if t is None:
            return False
        if now - t >= self.touch_interval_s:
            self._stamp(key, now)
        if self.on_event is not None:
            self.on_event(key, -1)
        return True

    def store(self, key: int, size: int, now: float) -> bool:
        if self.on_event is not None:
            self.on_event(key, size)
        if key in self.stamps:  # check before write: only the stamp changes
            self._stamp(key, now)
            return True
        self.stamps.insert(key, size, now)
        self._maybe_gc(now)
        return True

    def _maybe_gc(self, now: float) -> None:
        since = now - self.last_gc if self.last_gc is not None else float("inf")
        if due(self.stamps, self.gc_interval_s, self.used, since):
            self.gc(now)

    def gc(self, now: float | None = None) -> int:
        """One collection pass; returns how many objects it deleted."""
        self.gc_passes += 1
        if now is not None:
            self.last_gc = now
        stamps = self.stamps
        victims = stamps.victims(stamps.to_free(stamps.used))
        for key in victims:
            stamps.remove(key)
        self.evictions += len(victims)
        return len(victims)


class EngineModel:
    """vLLM's prefix cache over blocks (``capacity`` blocks, the null block excluded).

    A running request holds its blocks (its full blocks stay findable by
    other requests: vLLM shares them); when it finishes, its full blocks go
    to the free queue in reverse order (the tail is evicted first) and its
    partial last block is freed uncached. A new request takes blocks from
    the cold end of the free queue."""

    __slots__ = ("_seq", "capacity", "evictions", "extra", "free", "on_event", "pinned", "running")

    def __init__(self, capacity_blocks: int, on_event: Callable[[int, int], None] | None = None):
        self.capacity = capacity_blocks
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, unused blocks, coldest first
        self.pinned: dict[int, int] = {}  # cached blocks of running requests -> how many hold them
        self.extra = 0  # blocks running requests hold beyond their full blocks
        self.running: list = []  # heap of (finish, seq, full blocks, extra)
        self.evictions = 0
        self.on_event = on_event
        self._seq = 0

    def release(self, now: float) -> None:
        """Finish every request whose finish time has come."""
        running, free, pinned = self.running, self.free, self.pinned
        while running and running[0][0] <= now:
            _, _, blocks, extra = heapq.heappop(running)
            self.extra -= extra
            for u in reversed(blocks):
                n = pinned.get(u, 0) - 1
                if n > 0:
                    pinned[u] = n
                    continue
                pinned.pop(u, None)
                free[u] = None
                free.move_to_end(u)
        while free and len(free) + len(pinned) + self.extra > self.capacity:
            free.popitem(last=False)
            self.evictions += 1

    def match(self, units: Sequence[int], limit: int) -> int:
        """Leading blocks of ``units[:limit]`` held (no state change)."""
        n = 0
        free, pinned = self.free, self.pinned
        for u in units[:limit]:
            if u not in free and u not in pinned:
                break
            n += 1
        return n

    def run(self, hit: Sequence[int], blocks: Iterable[int], needed: int, finish: float | None = None) -> None:
        """Serve a request: its ``hit`` blocks are reused, ``needed`` blocks in
        all are held until ``finish`` (None: at once), its full ``blocks`` (in
        order) cached."""
        free, pinned = self.free, self.pinned
        blocks = list(blocks)
        for u in hit:
            free.pop(u, None)
            pinned[u] = pinned.get(u, 0) + 1
        new = [u for u in blocks[len(hit):]]
        # Taking new blocks evicts cached blocks of finished requests, coldest first.
        extra = max(0, needed - len(blocks))
        while free and len(free) + len(pinned) + self.extra + len(new) + extra > self.capacity:
            free.popitem(last=False)
            self.evictions += 1
        for u in new:
            if u in free:  # the same content, cached by another request
                del free[u]
            pinned[u] = pinned.get(u, 0) + 1
        if self.on_event is not None:
            for u in reversed(blocks):
                self.on_event(u, 1)
        self.extra += extra
        self._seq += 1
        heapq.heappush(self.running, (finish if finish is not None else float("-inf"), self._seq, blocks, extra))
        if finish is None:
            self.release(float("-inf"))
