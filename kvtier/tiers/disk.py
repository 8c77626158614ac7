"""Local disk tier (NVMe): one owner process, byte capacity, an eviction
policy (LRU by default) over kvtier's own access index.

The index (the policy over the objects held, with their paths) is rebuilt
at start from the objects on disk plus an append-only access log, least
recently used first, so recency survives restarts without trusting atime.
Log records are 48 bytes: key digest (32), namespace prefix (8), access time
(f64). The log is compacted at start and close. An exclusive ``flock`` on ``kvtier-v1/disk.lock`` keeps a second
process from sharing the directory (that is what the shared tier is for).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.codec import ChunkObject
from kvtier.configfields import opt
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.layout import ObjectEntry
from kvtier.tiers.dir.filetier import FileTier, FileTierConfig
from kvtier.tiers.dir.stamps import LoadStamps
from kvtier.tiers.eviction import EvictionPolicy, check, make

log = logging.getLogger(__name__)

_REC = struct.Struct("<32s8sd")
_FLUSH_S = 2.0
OWNER_LOCK = "disk.lock"  # under kvtier-v1/; `kvtier store` tries it too (admin/dirstore.py)
ACCESS_LOG = "access.log"  # under kvtier-v1/; `kvtier store gc --dry-run` reads it too


def by_recency(odir: ObjectDir) -> tuple[list[tuple[bytes, ObjectEntry, float]], int]:
    """A disk tier's objects in ``odir``, least recently used first by its
    access log (an object the log does not name: by its file's mtime), as
    (key digest, entry, last use); and the log's length in bytes. Reads
    only: the tier's start and ``kvtier store gc --dry-run`` order alike."""
    files: dict[bytes, ObjectEntry] = {}
    for e in odir.scan():
        try:
            digest = bytes.fromhex(e.key_hex)
            bytes.fromhex(e.ns_hex)
        except ValueError:
            continue  # not a name kvtier writes: not ours to count or evict
        files[digest] = e
    data = _read_log(odir.base / ACCESS_LOG)
    last: dict[bytes, float] = {}
    for off in range(0, len(data) - len(data) % _REC.size, _REC.size):
        digest, _, t = _REC.unpack_from(data, off)
        last[digest] = t
    order = sorted(files, key=lambda d: last.get(d, files[d].mtime))
    return [(d, files[d], last.get(d, files[d].mtime)) for d in order], len(data)


def _read_log(path: Path) -> bytes:
    """The access log's bytes; none where it is missing or unreadable
    (recency is a hint) or a link stands in its place (never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class DiskConfig(FileTierConfig):
    name: str = opt("disk", "tier name in metrics and logs")
    eviction: str = opt("lru", "eviction policy: lru or lfu")

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check(self.eviction, self, f"{prefix}eviction")


class DiskTier(FileTier):
    kind = "disk"
    Config = DiskConfig

    def __init__(self, config: DiskConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        # digest -> path, walked in eviction order (``config.eviction``).
        self._index: EvictionPolicy[bytes, Path] = make(config.eviction, config)
        self._used = 0  # the index's bytes and those of writes admitted and not yet published
        self._lockfd = self._take_ownership()
        swept = self.dir.sweep_tmp(0.0)  # we own the directory: every temp file is an orphan
        if swept:
            log.info("tier %s: swept %d orphaned temp files", self.name, swept)
        self._log_path = self.dir.base / ACCESS_LOG
        self._rebuild_index()
        try:
            fd = self.dir.open_private_file(self._log_path.name, os.O_WRONLY | os.O_APPEND)
        except BaseException:
            os.close(self._lockfd)
            raise
        self._log = os.fdopen(fd, "ab", buffering=1 << 16)
        self._log_failed = False
        self._last_flush = time.monotonic()
        self.metrics.used(self._used)

    def _take_ownership(self) -> int:
        # This user's file alone: a lock another user can open is one they can hold.
        fd = self.dir.open_private_file(OWNER_LOCK, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{self.name}.path",
                f"{self.config.path} is already used by another kvtier process",
                "give each process its own disk directory, or use a shared tier for a directory many processes use",
            ) from None
        return fd

    def _rebuild_index(self) -> None:
        order, log_len = by_recency(self.dir)
        for d, e, _ in order:
            self._index.insert(d, e.size, e.path)
            self._used += e.size
        self._compact_log([_REC.pack(d, bytes.fromhex(e.ns_hex)[:8], t) for d, e, t in order], log_len)
        # Over capacity after a restart with a smaller limit: evict now.
        with self._lock:
            victims = self._evict_locked(0)
        self._unlink_victims(victims)

    def _compact_log(self, records: list[bytes], old_len: int) -> None:
        """Rewrite the log with one record per object. On a full disk the old
        log stays (recency is a hint; objects never depend on it), cut to
        whole records so that appends stay aligned."""
        tmp = self._log_path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(records))
            os.replace(tmp, self._log_path)
        except OSError as exc:
            log.warning("tier %s: cannot compact the access log (%s); keeping it", self.name, exc.strerror or exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if old_len % _REC.size:
                os.truncate(self._log_path, old_len - old_len % _REC.size)

    def _record(self, key: ChunkKey) -> None:
        # Caller holds self._lock (the log shares it). Flushed every few
        # seconds: a crash loses at most that much recency, never objects.
        # A log that cannot be written (disk full) is given up for this run:
        # recency is a hint, and reads must not fail for it.
        if self._log_failed:
            return
        try:
            self._log.write(_REC.pack(key.digest, key.ns[:8], time.time()))
            now = time.monotonic()
            if now - self._last_flush > _FLUSH_S:
                self._log.flush()
                self._last_flush = now
        except OSError as exc:
            self._log_failed = True
            log.warning("tier %s: access log write failed (%s); recency is not recorded until restart",
                        self.name, exc.strerror or exc)
            self.metrics.error("access_log")

    def lookup(self, keys, timeout: float | None = None) -> int:
        """Answered from the in-memory index: no I/O, no wait."""
        with self._lock:
            for i, k in enumerate(keys):
                if k.digest not in self._index:
                    return i
            return len(keys)

    # ------------------------------------------------------------ hooks
    def _exists(self, key: ChunkKey) -> bool:
        with self._lock:
            return key.digest in self._index

    def _admit(self, key: ChunkKey, obj: ChunkObject) -> bool:
        size = obj.nbytes
        if size > self.capacity:
            return False
        with self._lock:
            victims = self._evict_locked(size)
            # Writes admitted but not yet published are not in the index and
            # cannot be evicted: if they alone leave no room, refuse.
            admitted = self._used + size <= self.capacity
            if admitted:
                self._used += size
        self._unlink_victims(victims)
        return admitted

    def _evict_locked(self, incoming: int) -> list[tuple[bytes, Path]]:
        index = self._index
        victims = []
        for d in index.victims(index.to_free(self._used, incoming)):
            victims.append((d, index.get(d)))
            self._used -= index.remove(d)
        return victims

    def _unlink_victims(self, victims: list[tuple[bytes, Path]]) -> None:
        for _, path in victims:
            self.dir.unlink_path(path)
        if victims:
            self.metrics.evicted(len(victims))
            self.metrics.used(self._used)
            self._removed([d for d, _ in victims])

    def _unadmit(self, key: ChunkKey, obj: ChunkObject) -> None:
        with self._lock:
            self._used -= obj.nbytes

    def _stored(self, key: ChunkKey, obj: ChunkObject) -> None:
        with self._lock:
            old = self._index.remove(key.digest)
            if old is not None:  # raced with another store of the same key
                self._used -= old
            self._index.insert(key.digest, obj.nbytes, self.dir.path(key))
            self._record(key)
            used = self._used
        self.metrics.used(used)

    def _touched(self, key: ChunkKey, mtime: float, op: OpenRead | None = None,
                 later: LoadStamps | None = None) -> None:
        with self._lock:
            if self._index.touch(key.digest):
                self._record(key)

    def _forget(self, key: ChunkKey) -> None:
        # Called after a read found no file, a delete or a quarantine. A store
        # of the same key may have published a fresh file meanwhile (and
        # indexed it, or be about to): forgetting that one would leave a file
        # on disk that capacity no longer counts. So look before dropping.
        gone = False
        with self._lock:
            if key.digest in self._index and not self.dir.exists(key):
                self._used -= self._index.remove(key.digest)
                gone = True
            used = self._used
        self.metrics.used(used)
        if gone:
            self._removed([key.digest])

    def clear(self) -> int:
        """Delete every object of this tier; returns how many."""
        with self._lock:
            victims = [(d, self._index.get(d)) for d in self._index]
            # Minus what was indexed only: writes admitted and still in
            # flight keep their share until they publish (or fail).
            self._used -= self._index.used
            self._index.clear()
        self._unlink_victims(victims)
        return len(victims)

    # ------------------------------------------------------------ contract
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, len(self._index), self._used, self.capacity)

    def close(self) -> None:
        super().close()
        with self._lock:
            if not self._log.closed:
                try:
                    self._log.close()
                except OSError:  # disk full: the tail of the log is lost, not an object
                    pass
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1


class DiskReader(FileTier):
    """A disk tier's folder seen by a process that does not own it (vLLM's
    scheduler, beside the worker that owns the folder): lookups by ``stat``,
    verified reads, no writes, no eviction, no recency stamps (the owner's
    index keeps recency). What the owner evicts simply stops being found."""

    kind = "disk"
    Config = DiskConfig

    def lookup(self, keys, timeout: float | None = None) -> int:
        for i, k in enumerate(keys):
            if not self.dir.exists(k):
                return i
        return len(keys)

    def store(self, objs) -> int:
        return 0  # the owner writes

    def _quarantine(self, key: ChunkKey) -> None:
        pass  # the owner's to move: its own read fails verification too

    def delete(self, keys) -> int:
        return 0

    def stats(self) -> TierStats:
        objects, used = 0, 0
        for e in self.dir.scan():
            objects += 1
            used += e.size
        return TierStats(self.name, self.kind, objects, used, self.capacity)

    @property
    def capacity(self) -> int:
        return self.config.capacity
