"""TieredStore: one cache over an ordered stack of tiers (fastest first).

- ``lookup``: the longest contiguous prefix held anywhere, as segments (which
  tier serves which run of chunks), each tier asked with one batched call.
- ``fetch``/``load``: read the prefix back, lower tiers in parallel within
  their read windows, promoting what they return into the memory tier.
- ``save``: encode once, keep in memory, write through to every lower tier in
  the background. The write-through backlog is bounded in bytes; what does not
  fit is dropped and counted, never waited for.

Ownership: the store owns its tiers, their executors, one prefetch pool and
every write-through future (``_pending``); ``close()`` drains them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from kvtier.buffers import BufferPool, LoadBuffers, copy_into, load_views, slot
from kvtier import auth
from kvtier.codec import HEADER_BLOCK, ChunkObject, encode, key_of, seal, seal_problem
from kvtier.config import StoreConfig, TierSpec
from kvtier.concurrency.breaker import CircuitBreaker
from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.metrics import Metrics
from kvtier.tiers import registry
from kvtier.tiers.base import FetchInto, Tier, TierStats

log = logging.getLogger(__name__)


class StoreListener(Protocol):
    """Hears objects enter a tier (``stored``: the memory tier at once, a
    lower one when its write-through landed) and leave it (``removed``,
    ``Tier.on_removed``), on the thread that did it: record and return."""

    def stored(self, tier: str, digests: list[bytes]) -> None: ...

    def removed(self, tier: str, digests: list[bytes]) -> None: ...


@dataclass(frozen=True)
class Segment:
    tier: str
    start: int
    stop: int


@dataclass(frozen=True)
class Lookup:
    chunks: int
    tokens: int
    segments: tuple[Segment, ...]

    def tokens_by_tier(self, keys: Sequence[ChunkKey]) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.segments:
            out[s.tier] = out.get(s.tier, 0) + sum(k.num_tokens for k in keys[s.start : s.stop])
        return out


class TieredStore:
    def __init__(self, config: StoreConfig, metrics: Metrics | None = None, chunk_bytes: int | None = None,
                 tier_class: Callable[[TierSpec], type[Tier]] | None = None):
        """``tier_class`` picks the class that opens a configured tier
        (default: the registry's class for its kind); the vLLM connector opens
        a disk folder another process owns with a reader, for instance."""
        self.config = config
        self.metrics = metrics or Metrics()
        # The cluster's keys (kvtier/auth.py): what this store writes is
        # sealed, and what a persistent tier returns is served only sealed.
        self.keyring: auth.Keyring | None = (
            auth.load_keyring(config.auth_key_file) if config.auth_key_file else None)
        self.pool = BufferPool(config.buffer_pool_bytes, huge=config.huge_pages)
        self.tiers: list[Tier] = []
        try:
            for i, spec in enumerate(config.tiers):
                if chunk_bytes is not None and spec.config.capacity < chunk_bytes:
                    raise ConfigError(
                        f"tiers[{i}].capacity",
                        f"{spec.config.capacity} B is smaller than one chunk ({chunk_bytes} B)",
                        f"give tier {spec.config.name!r} room for many chunks (at least {chunk_bytes} B)",
                    )
                cls = tier_class(spec) if tier_class is not None else registry.resolve(spec.kind, f"tiers[{i}].kind")
                breaker = CircuitBreaker(config.breaker_threshold, config.breaker_cooldown_s)
                self.tiers.append(cls(spec.config, self.metrics, breaker, self.pool))
        except BaseException:
            for t in self.tiers:
                t.close()
            raise
        self._by_name = {t.name: t for t in self.tiers}
        if self.keyring is None:
            _warn_unkeyed([t for t in self.tiers if t.shared_medium])
        # Tiers that fill a load's buffers themselves (``FetchInto``), asked
        # once: a runtime protocol check costs tens of microseconds a call.
        self._fills = {t.name for t in self.tiers if isinstance(t, FetchInto)}
        # Buffers of whole huge pages for O_DIRECT reads, unless a tier keeps
        # what it is handed (they would hold up to a third more memory each).
        self.pool.whole_reads = not any(t.keeps_buffers for t in self.tiers)
        # The memory level: the first tier in host DRAM (process-local or
        # node-wide); what lower tiers return is promoted into it.
        self.memory: Tier | None = next((t for t in self.tiers if t.host_memory), None)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as write-through jobs finish
        self._pending: set[Future] = set()
        self._pending_bytes = 0
        self._prefetcher = PriorityExecutor("prefetch", 2)
        self._closed = False
        self._listener: StoreListener | None = None

    def listen(self, listener: "StoreListener") -> None:
        """Tell ``listener`` what enters and leaves each tier from now on
        (KV events for routers); unheard, one attribute check per batch."""
        self._listener = listener
        for t in self.tiers:
            t.on_removed = listener.removed

    def _entered(self, tier: Tier, objs: Sequence[ChunkObject], n: int) -> None:
        if self._listener is not None and n > 0:
            self._listener.stored(tier.name, [key_of(o).digest for o in objs[:n]])

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    # ------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[ChunkKey], skip: frozenset[str] = frozenset()) -> Lookup:
        """Longest contiguous prefix over all tiers but those named in ``skip``.

        Each step asks the tiers, fastest first, for the run starting at the
        current position and takes the first non-empty answer.
        """
        return self._plan(keys, skip, ask_last=True)

    def _plan(self, keys: Sequence[ChunkKey], skip: frozenset[str], ask_last: bool) -> Lookup:
        """``lookup``; without ``ask_last``, the plan of a fetch that was
        given none: the last tier is not asked but given all that the tiers
        before it leave, since its read stops at its first miss anyway. A
        lookup there would only repeat the reads' own work ahead of them (a
        check per chunk before its open: on a shared file system, one more
        round trip to its metadata server per chunk, docs/benchmarks.md).
        The plan's ``chunks`` and ``tokens`` then count what was asked for,
        not hits."""
        pos, segments = 0, []
        tiers = [t for t in self.tiers if t.name not in skip]
        while pos < len(keys):
            for tier in tiers:
                if tier is tiers[-1] and not ask_last:
                    n = len(keys) - pos
                else:
                    n = tier.lookup(keys[pos:], self.config.lookup_timeout_s)
                if n:
                    segments.append(Segment(tier.name, pos, pos + n))
                    pos += n
                    break
            else:
                break
        return Lookup(pos, sum(k.num_tokens for k in keys[:pos]), tuple(segments))

    # ------------------------------------------------------------ load
    def fetch(self, keys: Sequence[ChunkKey], plan: Lookup | None = None,
              promote: bool | None = None) -> Iterator[ChunkObject]:
        """Yield the verified objects of the leading chunks, in order.

        Reads of every segment start at once; iteration stops at the first
        chunk that could not be served (evicted since lookup, corrupt, slow).
        What lower tiers return goes into the memory tier once the consumer
        is done with it, if ``promote`` (default: the store's setting).
        """
        return self._fetch(keys, plan, promote)

    def fetching(self, keys: Sequence[ChunkKey]) -> "Fetch":
        """``fetch``, handed over explicitly (``Fetch``): the caller takes
        each object, says when what it took may go into the memory tier,
        and closes it."""
        plan = self._plan(keys, frozenset(), ask_last=False)
        return Fetch(self, plan, self._fetch(keys, plan, False))

    def _promotes(self, tier: Tier) -> bool:
        """Whether what ``tier`` returns goes into the memory tier once the
        consumer is done with it. What a non-persistent tier lends stays
        that tier's."""
        return self.memory is not None and tier is not self.memory and tier.persistent

    def _fetch(self, keys: Sequence[ChunkKey], plan: Lookup | None, promote: bool | None,
               into: Sequence[memoryview] | None = None, clocked: bool = True) -> Iterator[ChunkObject]:
        """``fetch``; with ``into``, each object's payload is in its buffer
        of ``into`` when it is yielded (a buffer of another size ends it),
        copied where the tier verifies it if the tier can (``fetch_into``),
        else here. ``clocked``: count this thread's CPU in the load
        (kvtier_load_caller_cpu_seconds) here, at each step; a caller that
        runs it through without a pause counts it once instead (the thread's
        clock is a system call)."""
        # Not while suspended at a yield: that time is the consumer's. A
        # generator resumed on another thread makes a delta meaningless, at
        # worst negative, so each is clamped (a counter refuses to go down).
        t0: float | None = time.thread_time() if clocked else 0.0
        spent = 0.0
        plan = plan if plan is not None else self._plan(keys, frozenset(), ask_last=False)
        promote = self.config.promote if promote is None else promote
        timeout = self.config.load_timeout_s
        streams = []
        for s in plan.segments:
            tier = self._by_name[s.tier]
            part = keys[s.start : s.stop]
            if into is not None and s.tier in self._fills:
                streams.append((tier, len(part), tier.fetch_into(part, into[s.start : s.stop], timeout), None))
            else:
                streams.append((tier, len(part), tier.fetch(part, timeout), None if into is None else into[s.start : s.stop]))
        try:
            for tier, want, it, copy_to in streams:
                got = 0
                for obj in it:
                    if self.keyring is not None and tier.persistent and not self._sealed(tier, obj):
                        tier.done_with(obj)
                        return
                    if copy_to is not None:
                        dst = slot(copy_to, got, obj.header.payload_len)
                        if dst is None:
                            tier.done_with(obj)
                            return
                        copy_into(dst, obj.payload)
                    got += 1
                    try:
                        if clocked:
                            spent += max(0.0, time.thread_time() - t0)
                            t0 = None
                        yield obj
                        if clocked:
                            t0 = time.thread_time()
                        # The consumer is done with it: now the memory tier may
                        # take it (and later evict and recycle it).
                        if promote and self._promotes(tier):
                            self._entered(self.memory, [obj], self.memory.store([obj]))
                    finally:
                        tier.done_with(obj)
                if got < want:
                    return
        finally:
            if clocked and t0 is None:  # closed at a yield: the consumer stopped early
                t0 = time.thread_time()
            for _, _, it, _ in streams:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if clocked:
                self.metrics.load_caller_cpu.inc(spent + max(0.0, time.thread_time() - t0))

    def _sealed(self, tier: Tier, obj: ChunkObject) -> bool:
        """Whether ``obj``, as ``tier`` returned it, proves it was written by
        a holder of a key of the ring; if not it is a miss, counted by
        reason. An unsealed or badly sealed object is deleted from the tier,
        so that the recomputed chunk is stored in its place. One sealed with
        a key this node does not hold is left: the node's key file may lag a
        rotation, and its peers still serve the object (``kvtier store
        verify --quarantine`` moves such objects aside on an operator's
        word)."""
        assert self.keyring is not None
        problem = seal_problem(obj, self.keyring)
        if problem is None:
            return True
        tier.metrics.auth_failed(problem)
        _warn_refused(tier.name, problem)
        if problem != auth.UNKNOWN_KEY:
            try:
                tier.delete([key_of(obj)])
            except Exception as exc:  # storage trouble: the next reader refuses it again
                log.warning("tier %s: could not delete a refused object: %s", tier.name, exc)
        return False

    def load(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview] | LoadBuffers,
             plan: Lookup | None = None) -> int:
        """Load the leading payloads into ``bufs``: the caller's own buffers
        (each exactly one payload long; copied into), or buffers this store
        lent (``load_buffers``: read into in place where the tier can).
        Returns how many leading chunks were loaded; the content of the other
        buffers is undefined."""
        n = 0
        t0 = time.thread_time()  # the whole load runs on this thread: one clock for it
        it = self._fetch(keys[: len(bufs)], plan, None, load_views(bufs, len(keys)), clocked=False)
        try:
            for _ in it:
                n += 1
        finally:
            it.close()
            self.metrics.load_caller_cpu.inc(max(0.0, time.thread_time() - t0))
        return n

    def load_buffers(self, count: int, payload_bytes: int) -> LoadBuffers:
        """``count`` buffers for chunks of ``payload_bytes``, lent to the
        caller to ``load`` into: a directory tier reads each chunk straight
        into its buffer and verifies it there, so the load copies nothing
        (``LoadBuffers`` says what the caller may do with them). Reuse them
        across loads: they come from the store's buffer pool."""
        return LoadBuffers(self.pool, count, payload_bytes, HEADER_BLOCK)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Prefetch:
        """Start reading the prefix into the memory tier in the background,
        chunk by chunk (see ``Prefetch``)."""
        pf = Prefetch(keys)
        pf.future = self._prefetcher.submit(LOAD, self._prefetch_now, pf)
        return pf

    def _prefetch_now(self, pf: Prefetch) -> int:
        it = self.fetch(pf.keys, promote=False)
        try:
            for obj in it:
                # Into memory here, whatever ``promote`` says: a prefetch is
                # asked for exactly that. Where memory refuses it (full of
                # pinned chunks), the loader reads the rest itself.
                if self.memory is None:
                    break
                n = self.memory.store([obj])
                self._entered(self.memory, [obj], n)
                if not n:
                    break
                pf.advance()
        finally:
            it.close()
            pf.end()
        return pf.stored_count()

    # ------------------------------------------------------------ save
    def save(
        self,
        keys: Sequence[ChunkKey],
        payloads: Sequence[memoryview],
        dtype: str,
        shapes: Sequence[tuple[int, ...]],
    ) -> int:
        """Encode (one copy; the caller's buffers are free on return), keep in
        memory and write through. Returns the number of chunks accepted."""
        objs = [encode(k, dtype, tuple(s), p, self.pool) for k, p, s in zip(keys, payloads, shapes)]
        try:
            return self.put(objs)
        finally:
            for o in objs:
                o.release()

    def put(self, objs: Sequence[ChunkObject]) -> int:
        """Store encoded objects. The caller keeps its own references; the
        memory tier and each write-through job take theirs."""
        if not objs:
            return 0
        if self.keyring is not None:
            for o in objs:
                seal(o, self.keyring)
        if self.memory is not None:
            self._entered(self.memory, objs, self.memory.store(objs))
        for tier in self.tiers:
            if tier is not self.memory and tier.persistent:
                self._write_through(tier, objs)
        return len(objs)

    def _write_through(self, tier: Tier, objs: Sequence[ChunkObject]) -> None:
        with self._lock:
            room = self.config.save_queue_bytes - self._pending_bytes
            n, nbytes = 0, 0
            for o in objs:
                if nbytes + o.nbytes > room:
                    break
                nbytes += o.nbytes
                n += 1
            self._pending_bytes += nbytes
        if n < len(objs):
            tier.metrics.dropped("queue_full", len(objs) - n)
        if not n:
            return
        batch = [o.retain() for o in objs[:n]]
        fut = tier.store_async(batch)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._written(f, nbytes, tier, batch))

    def _written(self, fut: Future, nbytes: int, tier: Tier, batch: list[ChunkObject]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("tier %s: write-through failed: %s", tier.name, fut.exception())
            tier.metrics.error("store")
        elif not fut.cancelled():
            self._entered(tier, batch, fut.result())
        for o in batch:
            o.release()
        # Last: once a job leaves _pending, flush() may return, so its
        # accounting (room in the backlog, error counts) must be done.
        with self._idle:
            self._pending.discard(fut)
            self._pending_bytes -= nbytes
            self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write-through job has finished and been accounted
        for (failures are counted, not raised); True if it drained in time.

        Waiting on the futures is not enough: a future's waiters wake before
        its done callback (``_written``) has run."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    # ------------------------------------------------------------ admin
    def stats(self) -> list[TierStats]:
        return [t.stats() for t in self.tiers]

    def close(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Drain (or cancel) write-through, then close every tier."""
        if self._closed:
            return
        self._closed = True
        if drain and not self.flush(timeout):
            log.warning("write-through did not drain within %ss; the rest is dropped", timeout)
        self._prefetcher.close(cancel_pending=not drain)
        for t in self.tiers:
            t.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(tier: str, what: str, message: str, *args) -> None:
    with _warned_lock:
        if (tier, what) in _warned:
            return
        _warned.add((tier, what))
    log.warning(message, *args)


def _warn_unkeyed(tiers: Sequence[Tier]) -> None:
    """Say once per tier and process what a shared medium without a key means."""
    for t in tiers:
        _warn_once(t.name, "unkeyed",
                   "tier %s (%s): no cluster key is configured, so anyone who can write this tier's storage can make "
                   "engines serve KV of their choice; give every node the same key file (kvtier auth keygen FILE, "
                   "then auth_key_file: FILE or KVTIER_AUTH_KEY_FILE=FILE; see docs/security.md)", t.name, t.kind)


def _warn_refused(tier: str, reason: str) -> None:
    _warn_once(tier, reason, "tier %s: refused an object (%s): %s; recomputing (kvtier_auth_failures_total counts "
               "them)", tier, reason, auth.SEAL_PROBLEMS[reason])


class Prefetch:
    """A read of ``keys`` into the memory tier, running in the background.

    The loader of the same request need not wait for the whole of it: chunk
    ``i`` is in memory once ``wait(i + 1)`` says so, so the engine copies the
    first chunks while later ones are still being read. ``wait`` says False
    once the prefetch ended without chunk ``i`` (a miss, a failed read,
    memory full): the loader reads the rest itself then.
    """

    def __init__(self, keys: Sequence[ChunkKey]):
        self.keys = list(keys)
        self.future: Future | None = None
        self._stored = 0
        self._ended = False
        self._cond = threading.Condition()

    def advance(self) -> None:
        with self._cond:
            self._stored += 1
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def stored_count(self) -> int:
        with self._cond:
            return self._stored

    def wait(self, n: int, timeout: float | None = None) -> bool:
        """Block until the first ``n`` keys are in memory (True) or the
        prefetch ended short of them or ``timeout`` passed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._stored >= n or self._ended, timeout)
            return self._stored >= n

    def result(self, timeout: float | None = None) -> int:
        """Wait for the whole prefetch; the number of leading chunks it put in memory."""
        assert self.future is not None
        return self.future.result(timeout)


class Fetch:
    """A fetch whose objects its consumer takes one at a time (``take``),
    each a reference of the consumer's own, and whose memory tier takes
    what was taken once the consumer says so (``promote``): a consumer that
    hands each object on promotes it after the hand-over, so that the
    object reaches its user first. ``close`` ends the reads; what was taken
    and not promoted stays out of memory.

    Threads: one consumer thread at a time.
    """

    def __init__(self, store: TieredStore, plan: Lookup, objects: Iterator[ChunkObject]):
        self._store = store
        self._tiers = [store.tier(s.tier) for s in plan.segments for _ in range(s.start, s.stop)]
        self._objects = objects
        self._taken = 0
        self._to_promote: list[ChunkObject] = []  # taken, not promoted yet: a reference each

    def take(self) -> ChunkObject | None:
        """The next verified object, retained for the caller (who releases
        it), or None where the fetch stops (a chunk that was not served)."""
        obj = next(self._objects, None)
        if obj is None:
            return None
        tier = self._tiers[self._taken]
        self._taken += 1
        if self._store.config.promote and self._store._promotes(tier):
            self._to_promote.append(obj.retain())
        return obj.retain()

    def promote(self) -> None:
        """Put what was taken so far into the memory tier (where the
        store's ``promote`` setting says so)."""
        t0 = time.thread_time()
        batch, self._to_promote = self._to_promote, []
        for obj in batch:
            try:
                self._store._entered(self._store.memory, [obj], self._store.memory.store([obj]))
            finally:
                obj.release()
        if batch:
            self._store.metrics.load_caller_cpu.inc(max(0.0, time.thread_time() - t0))

    def close(self) -> None:
        for obj in self._to_promote:
            obj.release()
        self._to_promote = []
        self._objects.close()

    def __enter__(self) -> "Fetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
