"""``PooledTier``: what the directory, Redis and S3 tiers share, the
machinery of lookups and reads on the tier's own pool.

Threads: callers (any thread) submit jobs to the tier's ``PriorityExecutor``;
jobs run on its workers; ``fetch`` hands objects over on the caller's thread.
"""

from __future__ import annotations

import abc
import logging
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Iterator, Sequence

from kvtier.buffers import copy_into, slot
from kvtier.codec import ChunkObject
from kvtier.concurrency.executor import LOAD, STORE, PriorityExecutor
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier
from kvtier.tiers.readstream import ReadStream

log = logging.getLogger(__name__)

# What a read window assumes an object weighs per token before the tier has
# read one (a tier learns the real figure from each object it reads).
DEFAULT_BYTES_PER_TOKEN = 16 << 10
# About how long one lookup job may spend checking keys one after the other.
# A check that takes a round trip (a network mount, an object store) gets a
# job of its own and all run in parallel; checks of a few microseconds (a
# local file system, a warm metadata cache) share a job, so that a lookup
# costs one hand-off to the pool, not one per key.
LOOKUP_JOB_S = 500e-6


class PooledTier(Tier):
    """The base of the tiers that read and check one object per call on a
    pool of their own: the directory tiers (disk, shm, shared), Redis and S3.
    Every call runs on the tier's pool, guarded by its circuit breaker.
    ``lookup`` runs one existence check per key in parallel (a round trip
    each on a network backend) within a deadline; ``fetch`` reads objects one
    at a time within a byte window (``ReadStream``); ``store_async`` runs
    ``store`` on the pool.

    A subclass sets ``executor`` (its ``PriorityExecutor``) in its
    constructor and implements ``_exists(key)`` and ``_read_one(key)``
    (object, None for a miss, raises for backend trouble) besides the rest of
    ``Tier``; it sets ``_backend_errors`` (the exceptions that mean backend
    trouble) and may override ``_served(keys)`` to record the reads it
    served and ``_describe(exc)`` to shorten backend errors in logs.
    ``_bytes_per_token`` (the read window's estimate of an object's size
    before it is read) starts at ``DEFAULT_BYTES_PER_TOKEN``; a tier updates
    it from the objects it reads.
    """

    executor: PriorityExecutor
    _backend_errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(self, config, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self._bytes_per_token = DEFAULT_BYTES_PER_TOKEN
        self._check_s: float | None = None  # seconds per existence check, smoothed (lookup jobs' sizing)

    @abc.abstractmethod
    def _exists(self, key: ChunkKey) -> bool:
        """Whether the backend holds ``key``'s object (runs on the pool;
        raises one of ``_backend_errors`` for trouble)."""

    @abc.abstractmethod
    def _read_one(self, key: ChunkKey) -> ChunkObject | None:
        """Read and verify ``key``'s object into a pooled buffer (runs on the
        pool): the object with its reference, None for a miss; raises for
        backend trouble, which ends the stream."""

    def store_async(self, objs: Sequence[ChunkObject]) -> Future:
        return self.executor.submit(STORE, self.store, objs)

    def _guard(self, ok: bool, op: str) -> None:
        self.breaker.record(ok)
        self.metrics.breaker(self.breaker.state != "closed")
        if not ok:
            self.metrics.error(op)

    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int:
        """Existence checks in parallel on the pool; the answer is the leading
        run of hits. Past ``timeout`` the answer is 0 (the request recomputes)."""
        if not keys or not self.breaker.allow():
            return 0
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        run = self._lookup_run()
        runs = [keys[i : i + run] for i in range(0, len(keys), run)]
        futs = [self.executor.submit(LOAD, self._leading_hits, r) for r in runs]
        n, ok = 0, True
        try:
            for f, r in zip(futs, runs):
                remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
                hits = f.result(remaining)
                n += hits
                if hits < len(r):
                    break
        except FutureTimeout:
            log.warning("tier %s: lookup timed out after %.1fs; treating as a miss", self.name, timeout)
            n, ok = 0, False
        except self._backend_errors as exc:
            log.warning("tier %s: lookup failed: %s", self.name, self._describe(exc))
            n, ok = 0, False
        finally:
            for f in futs:
                f.cancel()
        self._guard(ok, "lookup")
        self.metrics.observe("lookup", time.perf_counter() - t0)
        return n

    def _lookup_run(self) -> int:
        """Keys per lookup job: one until the tier has timed its checks."""
        per = self._check_s
        return 1 if per is None else max(1, min(64, int(LOOKUP_JOB_S / max(per, 1e-7))))

    def _leading_hits(self, keys: Sequence[ChunkKey]) -> int:
        """Check ``keys`` in order on this thread (a pool job); how many lead
        before the first miss. Times the checks for ``_lookup_run``."""
        t0 = time.perf_counter()
        hits = checks = 0
        for k in keys:
            checks += 1
            if not self._exists(k):
                break
            hits += 1
        per = (time.perf_counter() - t0) / checks if checks else None
        if per is not None:
            prev = self._check_s
            self._check_s = per if prev is None else 0.8 * prev + 0.2 * per
        return hits

    def fetch(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> Iterator[ChunkObject]:
        return self._open(keys, None, timeout)

    def fetch_into(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview],
                   timeout: float | None = None) -> Iterator[ChunkObject]:
        """``fetch``, with each object's payload copied into the matching
        buffer of ``bufs`` (unsigned bytes, a payload long each) before it is
        yielded; a buffer of another size ends the fetch there. The copies
        run where the stream verifies objects if it can (``delivers``), else
        on the caller's thread; none is under way once the iterator is closed."""
        return self._open(keys, bufs, timeout)

    def _open(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview] | None,
              timeout: float | None) -> Iterator[ChunkObject]:
        """``fetch`` (``bufs`` None) or ``fetch_into``."""
        if not keys:
            return iter(())
        if not self.breaker.allow():
            self.metrics.miss(len(keys))
            return iter(())
        stream = self._stream(keys, bufs)
        copy_here = None if bufs is None or stream.delivers else bufs
        return _Fetch(self._drain(stream, keys, timeout, time.perf_counter(), copy_here), stream)

    def _stream(self, keys: Sequence[ChunkKey], into: Sequence[memoryview] | None = None) -> ReadStream:
        """The reader of one fetch: ``_read_one`` per key on the pool, within
        the read window. A tier with a better way to keep many reads in
        flight returns its own (``iter``, ``stop``, ``failed``, ``delivers``
        alike), which may copy objects into ``into`` as it verifies them."""
        return ReadStream(self.executor, keys, self._read_one, self.config.read_window_bytes, lambda: self._bytes_per_token)

    def _drain(self, stream, keys: Sequence[ChunkKey], timeout: float | None, t0: float,
               into: Sequence[memoryview] | None = None) -> Iterator[ChunkObject]:
        """Hand over the stream's objects, counting them; with ``into``,
        copy each into its buffer first (a buffer of another size ends it)."""
        served = nbytes = tokens = 0
        try:
            for obj in stream.iter(timeout):
                if into is not None:
                    dst = slot(into, served, obj.header.payload_len)
                    if dst is None:
                        obj.release()
                        break
                    copy_into(dst, obj.payload)
                served += 1
                nbytes += obj.nbytes
                tokens += obj.header.num_tokens
                yield obj
        finally:
            # Hits count what was handed over (reads ahead of a miss or of an
            # abandoned fetch complete too, but served nobody), once per
            # fetch: counted per object, they are a visible part of a cold
            # load's CPU (docs/benchmarks.md).
            self.metrics.hit(served, tokens, nbytes)
            if stream.failed is not None:
                what = "timed out" if isinstance(stream.failed, FutureTimeout) else f"failed: {self._describe(stream.failed)}"
                log.warning("tier %s: read %s; the rest is recomputed", self.name, what)
                self._guard(False, "load")
            else:  # a clean miss is a healthy answer too (and ends a half-open probe)
                self._guard(True, "load")
            self.metrics.miss(len(keys) - served)
            if served and stream.failed is None:
                self._served(keys[:served])
                self._streamed(stream, nbytes, time.perf_counter() - t0)

    def _served(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were served by one fetch (after the last was handed over)."""

    def _streamed(self, stream, nbytes: int, seconds: float) -> None:
        """``stream`` (from ``_stream``) served ``nbytes`` in ``seconds``, from
        the fetch's start to its end, without failing."""

    def _describe(self, exc: BaseException) -> str:
        return str(exc)


class _Fetch:
    """What ``fetch`` returns: ``_drain``'s generator, whose stream is
    stopped when it is closed even if it was never started. A store's fetch
    starts the reads of all its segments at once and closes them all when it
    ends; one that ends before a later segment (an earlier tier missed a
    chunk its lookup had found) never starts that segment's generator, and
    closing a generator that never ran runs none of its code: its stream
    went on reading every key for nobody, its objects never released."""

    __slots__ = ("_gen", "_stream", "_started")

    def __init__(self, gen: Iterator[ChunkObject], stream):
        self._gen, self._stream, self._started = gen, stream, False

    def __iter__(self) -> "_Fetch":
        return self

    def __next__(self) -> ChunkObject:
        self._started = True
        return next(self._gen)

    def close(self) -> None:
        if not self._started:
            self._stream.stop(0)
        self._gen.close()
