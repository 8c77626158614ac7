"""Base of the directory tiers: verified parallel reads, atomic writes,
circuit breaker and timeouts around every backend call.

Threads: callers (any thread) submit jobs to this tier's own
``PriorityExecutor``; jobs run on its workers. Subclasses decide where an
object may live (``_admit``), remember accesses (``_touched``) and forget
removed objects (``_forget``).
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Sequence

from kvtier.codec import ChunkObject
from kvtier.engine.breaker import CircuitBreaker
from kvtier.engine.executor import DELETE, STORE, PriorityExecutor
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier
from kvtier.tiers.files import FileTierConfig, ObjectDir, PooledIO

log = logging.getLogger(__name__)

_DEFAULT_BYTES_PER_TOKEN = 16 << 10


class FileTier(PooledIO, Tier):
    Config = FileTierConfig

    def __init__(self, config: FileTierConfig, metrics=None, breaker: CircuitBreaker | None = None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.dir = ObjectDir(config.path, f"{self.name}.path")
        self.executor = PriorityExecutor(self.name, config.io_threads)
        self._bytes_per_token = _DEFAULT_BYTES_PER_TOKEN

    # ------------------------------------------------------------ hooks
    def _admit(self, key: ChunkKey, obj: ChunkObject) -> bool:
        """Make room for ``obj``; False refuses the store (counted by caller)."""
        return True

    def _stored(self, key: ChunkKey, obj: ChunkObject) -> None:
        """``obj`` is now published."""

    def _unadmit(self, key: ChunkKey, obj: ChunkObject) -> None:
        """A store admitted by ``_admit`` failed."""

    def _touched(self, key: ChunkKey, mtime: float) -> None:
        """``key`` was just read (its file had ``mtime``)."""

    def _forget(self, key: ChunkKey) -> None:
        """``key`` is gone (deleted, missing or quarantined)."""

    def _exists(self, key: ChunkKey) -> bool:
        return self.dir.exists(key)

    def _quarantine(self, key: ChunkKey) -> None:
        """``key``'s object failed verification: move it aside."""
        self.dir.quarantine(key)
        self._forget(key)

    # ------------------------------------------------------------ contract
    def _read_one(self, key: ChunkKey) -> ChunkObject | None:
        t0 = time.perf_counter()
        try:
            obj, mtime = self.dir.read(key, self.config.o_direct, self.config.cold_reads, self.pool)
        except FileNotFoundError:
            self._forget(key)
            return None
        except CorruptObject as exc:
            log.warning("tier %s: object %s failed verification (%s); quarantined", self.name, key.hex[:16], exc)
            self.metrics.corrupt()
            self._quarantine(key)
            return None
        h = obj.header
        self._bytes_per_token = max(1, obj.nbytes // max(1, h.num_tokens))
        self.metrics.observe("read", time.perf_counter() - t0)
        self._touched(key, mtime)
        return obj

    def store(self, objs: Sequence[ChunkObject]) -> int:
        """Write objects synchronously (callers run this on the tier's pool
        via ``store_async``). Stops at the first failure: later chunks would
        sit behind a gap."""
        if not self.breaker.allow():
            self.metrics.dropped("breaker_open", len(objs))
            return 0
        for n, obj in enumerate(objs):
            ok, reason = self._store_one(key_of(obj), obj)
            if not ok:
                self.metrics.dropped(reason, len(objs) - n)
                return n
        return len(objs)

    def store_async(self, objs: Sequence[ChunkObject]):
        return self.executor.submit(STORE, self.store, objs)

    def _store_one(self, key: ChunkKey, obj: ChunkObject) -> tuple[bool, str]:
        if self._exists(key):
            self.metrics.skipped()
            self._touched(key, 0.0)
            return True, ""
        if not self._admit(key, obj):
            return False, "capacity"
        t0 = time.perf_counter()
        try:
            self.dir.write(obj, key, self.config.fsync)
        except OSError as exc:
            self._unadmit(key, obj)
            log.warning("tier %s: write failed (%s); chunk dropped", self.name, exc.strerror or exc)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full file system (or quota) is not a failing one: reads
                # must go on, so the breaker does not count it.
                return False, "no_space"
            self._guard(False, "store")
            return False, "error"
        self._guard(True, "store")
        self._stored(key, obj)
        self.metrics.wrote(obj.nbytes)
        self.metrics.observe("write", time.perf_counter() - t0)
        return True, ""

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self.executor.submit(DELETE, self._delete_now, keys).result()

    def _delete_now(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        for k in keys:
            if self.dir.unlink(k):
                n += 1
            self._forget(k)
        return n

    def drop_cache(self) -> int:
        return self.dir.drop_cache()

    def close(self) -> None:
        self.executor.close()


def key_of(obj: ChunkObject) -> ChunkKey:
    h = obj.header
    return ChunkKey(h.key, h.check, h.ns, h.num_tokens)
