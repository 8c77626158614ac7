"""Node memory tier: host DRAM that every process of one node shares.

vLLM runs its scheduler and its workers in different processes (tensor
parallel, its default multiprocess mode), and a node often runs several
engines (data parallel, or one ``vllm serve`` per GPU). A chunk in one
process's private memory is invisible to the others: the scheduler would
decide from a memory that is not the workers', and every engine would keep
its own copy of the same session. This tier keeps chunks as files in a
directory on tmpfs (``/dev/shm``), which is host DRAM: every process that
opens the same path sees the same chunks, and the capacity is enforced once
for the node.

- Publication: atomic rename from ``tmp/`` (``ObjectDir``): a reader sees
  nothing or a whole, verified object.
- Capacity: a ledger of the bytes held (``kvtier-v1/node.ledger``, one u64)
  changes only under an exclusive ``flock`` of ``kvtier-v1/node.lock``. A
  store reserves its size and creates its temp file at that full size under
  the lock, so the ledger always equals the published objects plus the temp
  files of live writers, and can be recomputed from a scan at any time (each
  open does: a writer that died leaves its reservation as a temp file, which
  is swept and not counted). Usage therefore never passes ``capacity``.
- Recency: a read stamps the object's mtime (at most every
  ``touch_interval_s``); eviction, under the lock, ranks the objects of a
  scan by those stamps and removes what the ``eviction`` policy picks (by
  default ``watermark``: the oldest stamps, down to ``low_watermark`` of
  capacity, in batches that keep the scans rare).
- An object evicted while a reader has it open stays readable until the
  reader closes it (POSIX); its pages are freed then. Reads take
  milliseconds, so that is the only moment usage can exceed the ledger.

Threads: any thread may call; the node lock is taken by one thread of a
process at a time (``_lock`` first: ``flock`` does not exclude two threads
sharing a descriptor). Reads and writes of object bytes run outside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
import os
import struct
import threading
from dataclasses import dataclass
from typing import ClassVar, Iterator, Sequence

from kvtier.codec import ChunkObject
from kvtier.configfields import opt, size_field
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.dir.filetier import FileTier
from kvtier.tiers.dir.layout import ObjectEntry
from kvtier.tiers.dir.stamps import LoadStamps
from kvtier.tiers.eviction import check, make, rank

log = logging.getLogger(__name__)

_U64 = struct.Struct("<Q")
NODE_LEDGER = "node.ledger"  # under kvtier-v1/; marks the folder as a node memory tier's (admin/dirstore.py)


def default_dir() -> str:
    """Where the node's memory tiers live unless configured: one folder per
    user (tier folders are 0700), on tmpfs."""
    return f"/dev/shm/kvtier-{os.getuid()}"


@dataclass(frozen=True)
class ShmConfig:
    # Every process of the node reads and writes the folder: recency is the
    # objects' stamps, which only a policy ranked by recency can use.
    stamped_recency: ClassVar[bool] = True

    capacity: int = size_field(0, "bytes of host DRAM for chunks, for the whole node (required)")
    path: str = opt("", "tmpfs directory every process of the node opens (default /dev/shm/kvtier-UID/NAME)")
    name: str = opt("shm", "tier name in metrics and logs")
    eviction: str = opt("watermark", "eviction policy: watermark or lru")
    low_watermark: float = opt(0.9, "eviction (watermark) brings usage down to this fraction of capacity", gt=0)
    touch_interval_s: float = opt(1.0, "minimum seconds between two recency stamps of one object", ge=0)
    io_threads: int = opt(4, "threads of this tier's I/O pool", ge=1)
    read_window_bytes: int = size_field(64 << 20, "bytes of reads in flight per load")
    # What the directory tiers' reader and writer expect of their config:
    # tmpfs is read and written buffered (there is no device to bypass the
    # page cache for).
    o_direct: bool = False
    aio: bool = False
    adaptive_reads: bool = False
    cold_reads: bool = False
    fsync: bool = False
    direct_writes: bool = False

    def validate(self, prefix: str = "") -> None:
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set for the node memory tier", "set it, e.g. capacity: 8GiB")
        if not 0 < self.low_watermark <= 1:
            raise ConfigError(f"{prefix}low_watermark", f"{self.low_watermark} is not in (0, 1]", "use e.g. 0.9")
        check(self.eviction, self, f"{prefix}eviction")
        if self.io_threads <= 0:
            raise ConfigError(f"{prefix}io_threads", "must be positive", "use e.g. 4")
        if self.read_window_bytes <= 0:
            raise ConfigError(f"{prefix}read_window_bytes", "must be positive", "use e.g. 64MiB")
        if self.touch_interval_s < 0:
            raise ConfigError(f"{prefix}touch_interval_s", "must not be negative", "use e.g. 1")

    def resolved(self) -> "ShmConfig":
        from dataclasses import replace

        return self if self.path else replace(self, path=os.path.join(default_dir(), self.name))


def _size(e: ObjectEntry) -> int:
    return e.size


def _mtime(e: ObjectEntry) -> float:
    return e.mtime


class ShmTier(FileTier):
    kind = "shm"
    Config = ShmConfig
    host_memory = True

    def __init__(self, config: ShmConfig, metrics=None, breaker=None, pool=None):
        config = config.resolved()
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        self._lockfd = self._ledger = -1
        try:
            # This user's files alone: a lock another user can open is one they can hold.
            self._lockfd = self.dir.open_private_file("node.lock", os.O_RDWR)
            self._ledger = self.dir.open_private_file(NODE_LEDGER, os.O_RDWR)
        except ConfigError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise ConfigError(f"{self.name}.path", f"{config.path} is not usable ({exc.strerror})",
                              "point it at a writable tmpfs directory, e.g. /dev/shm/kvtier") from None
        with self._node():
            used = self._reconcile()
        self.metrics.used(used)

    # ------------------------------------------------------------ the ledger
    @contextlib.contextmanager
    def _node(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._lockfd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lockfd, fcntl.LOCK_UN)

    def _used(self) -> int:
        data = os.pread(self._ledger, _U64.size, 0)
        return _U64.unpack(data)[0] if len(data) == _U64.size else 0

    def _set_used(self, n: int) -> None:
        os.pwrite(self._ledger, _U64.pack(max(0, n)), 0)

    def _reconcile(self) -> int:
        """Node lock held: recompute the ledger from the directory."""
        self.dir.sweep_tmp(float("inf"))  # this node's dead writers only
        # Temp files first: other processes publish (rename out of tmp/)
        # without the lock, and a write published between the two walks is
        # then counted twice, which the next reconcile corrects, instead of
        # not at all (the node then held one object more than its capacity).
        in_flight = self.dir.tmp_bytes()
        used = in_flight + sum(e.size for e in self.dir.scan())
        self._set_used(used)
        return used

    def _evict_locked(self, need: int) -> int:
        """Node lock held: remove what the eviction policy picks, by the
        objects' stamps, until ``need`` more bytes fit under capacity (with
        ``watermark``, down to the low watermark). Returns the usage after.

        The ledger, not the scan, says how much to free (it counts writes in
        flight too), and a victim counts what its unlink freed: one another
        process removed first frees nothing here, and the walk goes on to
        the next."""
        used = self._used()
        policy = make(self.config.eviction, self.config)
        free = policy.to_free(used, need)
        if free <= 0:
            return used
        rank(policy, self.dir.scan(), _size, _mtime)
        evicted: list[bytes] = []
        while free > 0 and len(policy):
            for e in policy.victims(free):
                if free <= 0:
                    break
                policy.remove(e)
                freed = self.dir.unlink_path(e.path)
                if freed is not None:
                    used -= freed
                    free -= freed
                    evicted.append(bytes.fromhex(e.key_hex))
        self._set_used(used)
        if evicted:
            self.metrics.evicted(len(evicted))
            self._removed(evicted)
        return used

    # ------------------------------------------------------------ contract
    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int:
        """A ``stat`` per key, inline: on tmpfs each takes microseconds, less
        than handing it to a pool."""
        for i, k in enumerate(keys):
            if not self.dir.exists(k):
                return i
        return len(keys)

    def _store_one(self, key: ChunkKey, obj: ChunkObject) -> tuple[bool, str]:
        if self.dir.exists(key):
            self.metrics.skipped()
            return True, ""
        size = obj.nbytes
        if size > self.capacity:
            return False, "capacity"
        with self._node():
            used = self._evict_locked(size)
            if used + size > self.capacity:
                return False, "capacity"
            try:
                w = self.dir.begin_write(size)
            except OSError as exc:
                log.warning("tier %s: write failed (%s); chunk dropped", self.name, exc.strerror or exc)
                return False, "no_space"
            self._set_used(used + size)
        try:
            w.fill(obj, False)
            w.publish(key)
        except OSError as exc:
            w.abort()
            with self._node():
                self._set_used(self._used() - size)
            log.warning("tier %s: write failed (%s); chunk dropped", self.name, exc.strerror or exc)
            return False, "no_space"
        self.metrics.wrote(size)
        self.metrics.used(used + size)
        return True, ""

    def _touched(self, key: ChunkKey, mtime: float, op: OpenRead | None = None,
                 later: LoadStamps | None = None) -> None:
        self.dir.stamp(key, mtime, self.config.touch_interval_s, op, later)

    def _stamped_since(self) -> float:
        # As the load begins: an object stamped since is not stamped again by it.
        return time.time() - self.config.touch_interval_s

    def _quarantine(self, key: ChunkKey) -> None:
        # Kept aside, a bad object would hold node DRAM the ledger no longer
        # counts: remove it instead (the metric and the log say it was bad).
        self._delete_now([key])

    def _delete_now(self, keys: Sequence[ChunkKey]) -> int:
        return self._unlink([(k.digest, lambda k=k: self.dir.unlink(k)) for k in keys])

    def clear(self) -> int:
        """Delete every object of this node tier (every process's); returns how many."""
        return self._unlink([(bytes.fromhex(e.key_hex), lambda p=e.path: self.dir.unlink_path(p))
                             for e in list(self.dir.scan())])

    def _unlink(self, removals) -> int:
        """Run each removal, ``(digest, remove)`` where ``remove()`` returns
        the bytes freed (None/0 if nothing was there), under the node lock
        and take what it freed off the ledger."""
        gone = []
        with self._node():
            used = self._used()
            for digest, remove in removals:
                freed = remove()
                if freed:
                    used -= freed
                    gone.append(digest)
            self._set_used(used)
        self.metrics.used(used)
        self._removed(gone)
        return len(gone)

    def stats(self) -> TierStats:
        with self._node():
            used = self._used()
        objects = sum(1 for _ in self.dir.scan())
        return TierStats(self.name, self.kind, objects, used, self.capacity)

    def drop_cache(self) -> int:
        return 0  # tmpfs pages are the tier itself

    def close(self) -> None:
        super().close()
        for fd in (self._lockfd, self._ledger):
            if fd >= 0:
                os.close(fd)
        self._lockfd = self._ledger = -1
