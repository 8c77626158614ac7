"""``AioStream``: the directory tiers' O_DIRECT reader. One driver thread
keeps a load's reads in flight on the device with Linux native AIO; each
object that lands is verified on the tier's pool (checksums of many objects
on as many cores); the consumer takes them in key order.

It answers to the same calls as ``ReadStream`` (``iter``, ``stop``,
``failed``, ``delivers``), with the same rules: objects are read into
buffers the stream takes from the pool, never into the caller's own, so a
read that lands after a timeout harms nobody; the stream stops at the first
miss; objects read but never handed over go back to the pool. Given the
caller's buffers (``into``, a load), the job that verified an object copies
its payload into its buffer, only while the consumer still wants it;
``stop`` returns once no such copy is under way. Given buffers kvtier lent
the caller (``LoadBuffers``), each object is read into its slot and
verified there: nothing is copied, and a read that lands late lands in a
slot the next load will not reuse (``LoadBuffers``).

What it saves, per object, against a pool thread per read: the thread
wake-ups and GIL hand-offs, and a future with its callbacks.

Threads: the driver runs as one LOAD job on the tier's ``PriorityExecutor``
(it may block in the kernel: a hung mount holds the driver, not the
consumer, whose wait is bounded by its deadline), and each verification as
another; the consumer's thread iterates; ``stop`` may come from any.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterator, Sequence

from kvtier.buffers import LoadBuffers, address, align_up, copy_into, slot
from kvtier.codec import ChunkObject
from kvtier.concurrency.executor import LOAD, PriorityExecutor, usable_cpus
from kvtier import observe
from kvtier.keys import ChunkKey
from kvtier.tiers.dir.aio import AioContext, ContextPool
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.readstream import MIN_INFLIGHT

log = logging.getLogger(__name__)

_ABSENT = object()
_MAX_PIECES = 64  # reads one object is cut into at most (request ids: index * _MAX_PIECES + piece)
# How long the driver waits for completions before looking whether the
# consumer stopped (a stopped stream submits nothing more).
_POLL_S = 0.05
# What of a load's bytes not landed yet may be in flight at once (besides
# the window): reads in flight together land together, and an object is
# verified only once it landed, so a load whose last reads all land at
# once then waits for all their checks. Tapered, each batch of reads lands
# while the next is still on the device, and its checks run then: with
# three quarters, each batch is a quarter of the one before, which hides
# its checks wherever they run at least 4x the device's rate
# (docs/benchmarks.md).
_TAPER = 0.75


class AioStream:
    """Reads ``keys`` within a byte window with native AIO on one driver
    thread; yields the verified objects in key order, stopping at the first
    miss.

    At least ``MIN_INFLIGHT`` objects are in flight, however small the
    window. The driver opens up to ``ahead`` objects (and takes their buffers)
    before the window has room for them, so that a read that lands is
    replaced by one submit call rather than by an open and a submit: on a
    disk that serves the reads in flight side by side, they land together,
    and opening their successors only then would leave the device idle at
    every window (docs/benchmarks.md).

    Nor is more than three quarters of what has not landed yet in flight
    (``_TAPER``): reads in flight together land together, so the load's
    reads land in shrinking batches, each checked while the next is on the
    device, and the load ends with the checks of a few objects, not of a
    window's worth.

    An object larger than ``piece_bytes`` is read as several requests of
    about one size (a 3 MiB chunk goes whole: smaller pieces cost CPU and
    gain no speed).

    The tier supplies the two halves of a read: ``begin(key, pool)`` opens
    the object and takes a buffer from ``pool`` (``OpenRead``; None for a
    miss; raises for backend trouble) and ``finish(key, op, got, t0, pool)``
    closes and verifies it (the object, owned by ``pool``, or None if it
    failed verification); ``ended()`` is called once the driver is done
    with ``begin`` (what ``begin`` held open for the load, it may close
    then); ``done()`` once the consumer is done (the first ``stop``);
    ``timed(opening_s, active_s)`` once the driver is done, if it opened
    anything: the seconds it spent opening objects, and from its first open
    to its end. ``read_sync(key)`` reads
    one object the ordinary way, for the rare file the file system would not
    open with O_DIRECT, and for reads the kernel refused (EINVAL: a file
    system that opens with O_DIRECT but refuses the I/O, or AIO on it);
    ``refused()`` is then called (on every refusal; the tier acts on the
    first), so that the tier's next loads read the ordinary way.
    """

    def __init__(
        self,
        executor: PriorityExecutor,
        keys: Sequence[ChunkKey],
        begin: Callable[[ChunkKey, object], OpenRead | None],
        finish: Callable[[ChunkKey, OpenRead, int, float, object], ChunkObject | None],
        read_sync: Callable[[ChunkKey], ChunkObject | None],
        pool,
        window_bytes: int,
        bytes_per_token: Callable[[], int],
        piece_bytes: int = 4 << 20,
        refused: Callable[[], None] = lambda: None,
        path: str = "",
        ahead: int = 2,
        contexts: ContextPool | None = None,
        verifiers: int | None = None,
        source: object = None,
        into: Sequence[memoryview] | LoadBuffers | None = None,
        ended: Callable[[], None] = lambda: None,
        done: Callable[[], None] = lambda: None,
        timed: Callable[[float, float], None] = lambda opening_s, active_s: None,
    ):
        self.path = path  # what the owner calls this way of reading (its accounting)
        self._keys = keys
        # Told when reads go to the kernel and land, as ``source`` (the
        # tier): the observer a benchmark installed, None in service.
        self._obs, self._source = observe.observed(source), source
        self._refused = refused
        self._ended = ended  # called once the driver is done (with ``begin`` too)
        # Called once, by the first ``stop`` (the consumer is done, or never
        # started), on the stopping thread: it must not block.
        self._done_hook: Callable[[], None] | None = done
        # Told, once the driver is done, the seconds it spent opening
        # objects (``OpenRead.opened_s``: not the buffers taken) and from its
        # first open to its end: where each open is a round trip (a network
        # or FUSE mount), the first is most of the second, and one driver
        # thread opens one object at a time where pool threads would open
        # them side by side. (Not io_submit's time: on a local disk it
        # includes writing back an object's dirty pages before an O_DIRECT
        # read, the device's work, which threads would wait for as well.)
        self._timed = timed
        self._opening_s = 0.0
        self._first: float | None = None
        self._begin = begin
        self._finish = finish
        self._read_sync = read_sync
        self._pool = pool
        self._window = window_bytes
        self._bpt = bytes_per_token
        self._piece = align_up(max(1, piece_bytes))
        # Where the driver's AIO context comes from, and goes back to: the
        # tier's, reused across loads; or one of this stream's own, freed at
        # the end. The pool owns the depth (iocbs in flight).
        self._contexts = contexts if contexts is not None else ContextPool(keep=0)
        if self._contexts.depth < _MAX_PIECES:
            raise ValueError(f"AIO contexts of depth {self._contexts.depth}: one object's {_MAX_PIECES} pieces must fit")
        self._ahead = max(1, ahead)  # objects opened ahead of room in the window
        self._cond = threading.Condition()
        self._results: dict[int, object] = {}  # index -> object, None (miss) or exception
        self._end = len(keys)  # first index that is a miss or an error: nothing past it is handed out
        self._consumed: int | None = None  # set by stop: results from here on are released
        self._done = False  # the driver has finished
        self._verifying = 0  # reads landed and not yet verified (queued or on the pool)
        # Landed reads wait here, lowest index first, for one of at most
        # ``verifiers`` jobs: the consumer's next object is verified first,
        # so it starts on it while later ones are checked. By default one
        # job per core but one (the driver's and the consumer's: more jobs
        # than cores cost more CPU than they save, docs/benchmarks.md).
        self._to_verify: list[tuple[int, _Read]] = []
        self._verifiers = 0  # verification jobs running
        self._max_verifiers = max(1, verifiers if verifiers is not None else usable_cpus() - 1)
        # The caller's buffers, where each verified object's payload is
        # copied by the job that verified it (``delivers``): landed objects'
        # copies then run on as many cores as their checks, not one after
        # the other on the consumer's thread.
        self._into = into
        self._lent = isinstance(into, LoadBuffers)  # read into its slots, in place
        self.delivers = into is not None
        self._copying = 0  # copies into the caller's buffers under way (``stop`` waits for them)
        self._crash: BaseException | None = None  # what ended the driver, if it failed
        self.failed: BaseException | None = None  # error or timeout that ended the stream
        self._executor = executor
        self._job = executor.submit(LOAD, self._drive)

    def _pool_for(self, i: int):
        """The pool object ``i``'s read takes its buffer from: its slot's
        lender with lent buffers, else the tier's pool."""
        if self._lent and i < len(self._into):
            return self._into.lender(i)
        return self._pool

    # ------------------------------------------------------------ driver
    def _drive(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # unexpected: the stream ends where the consumer is
            log.warning("kvtier: a read stream's driver failed: %s", exc)
            if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
                self._refused()  # io_submit refused: the next loads read the ordinary way
            with self._cond:
                self._crash = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _run(self) -> None:
        ctx = self._contexts.take()
        pending: dict[int, _Read] = {}  # index -> read in flight
        staged: deque[tuple[int, _Read, list]] = deque()  # opened, waiting for room in the window
        backlog: list[tuple[int, int, int, int, int]] = []  # pieces the kernel has not taken yet
        nxt, inflight = 0, 0
        tokens_left = sum(k.num_tokens for k in self._keys)  # of the reads not landed yet
        try:
            while True:
                with self._cond:
                    limit = self._end if self._consumed is None else min(self._end, self._consumed)
                submitting = nxt < limit
                while staged and staged[-1][0] >= limit:  # past a miss, or the consumer stopped
                    r = staged.pop()[1]
                    r.op.abandon(r.pool)
                room = ctx.room - len(backlog)
                while True:
                    # Into flight what was opened ahead, as far as the window
                    # allows: a read that lands is replaced by one submit call,
                    # not by an open on the driver's critical path.
                    cap = min(self._window, int(_TAPER * tokens_left * self._bpt()))
                    while staged and (len(pending) < MIN_INFLIGHT or inflight + staged[0][1].est <= cap) \
                            and len(staged[0][2]) <= room:
                        i, r, pieces = staged.popleft()
                        pending[i] = r
                        addr = address(r.op.buf)
                        backlog.extend((i * _MAX_PIECES + j, r.op.fd, addr + off, n, off) for j, (off, n) in enumerate(pieces))
                        inflight += r.est
                        room -= len(pieces)
                    if not self._submit(ctx, backlog):
                        break
                    if not (submitting and nxt < len(self._keys) and len(staged) < self._ahead):
                        break
                    key = self._keys[nxt]
                    est = max(1, key.num_tokens * self._bpt())
                    t0 = time.perf_counter()
                    if self._first is None:
                        self._first = t0
                    pool = self._pool_for(nxt)
                    try:
                        op = self._begin(key, pool)
                    except Exception as exc:
                        self._set(nxt, exc)
                        submitting = False
                        continue
                    if op is None:
                        self._set(nxt, None)
                        submitting = False
                        continue
                    self._opening_s += op.opened_s
                    n = min(_MAX_PIECES, -(-len(op.buf) // self._piece))
                    piece = align_up(-(-len(op.buf) // n))  # n pieces of (about) one size
                    pieces = _pieces(len(op.buf), piece)
                    if not op.direct:
                        op.abandon(pool)
                        if pending or staged:
                            break  # read it alone once the reads ahead of it landed
                        self._set(nxt, self._sync(nxt))  # the file system refused O_DIRECT for it
                        nxt += 1
                        continue
                    staged.append((nxt, _Read(op, pool, est, t0, piece, len(pieces)), pieces))
                    nxt += 1
                if not ctx.inflight:
                    with self._cond:
                        if not staged and (self._consumed is not None or nxt >= min(self._end, len(self._keys))):
                            return
                    continue
                landed, reaped = [], ctx.reap(1, _POLL_S)
                if self._obs is not None and reaped:
                    self._obs.reads_landed(self._source, len(reaped))
                for rid, res in reaped:
                    i, j = divmod(rid, _MAX_PIECES)
                    r = pending[i]
                    r.results[j] = res
                    r.left -= 1
                    if r.left:
                        continue
                    del pending[i]
                    inflight -= r.est
                    tokens_left -= self._keys[i].num_tokens
                    errs = [-x for x in r.results.values() if x < 0]
                    if errs and errno.EINVAL in errs:
                        # Refused, not failed: read it the ordinary way (which
                        # falls back to buffered if O_DIRECT itself is refused).
                        r.op.abandon(r.pool)
                        self._refused()
                        self._set(i, self._sync(i))
                    elif errs:
                        r.op.abandon(r.pool)
                        self._set(i, OSError(errs[0], f"read failed: {os.strerror(errs[0])}"))
                    else:
                        landed.append((i, r))
                if landed:
                    self._landed(landed)
        finally:
            self._contexts.give(ctx)  # waits for every read still in flight: their buffers are free after
            for r in pending.values():
                r.op.abandon(r.pool)
            for _, r, _ in staged:
                r.op.abandon(r.pool)
            self._ended()
            if self._first is not None:
                self._timed(self._opening_s, time.perf_counter() - self._first)

    def _landed(self, reads: list[tuple[int, "_Read"]]) -> None:
        """Queue landed reads (all of one reap: the lowest index among them
        is verified first) for verification; start verification jobs while
        fewer than ``verifiers`` run. Verified on the pool, not here:
        checksums of several objects then run on as many cores, and the
        driver goes straight back to keeping the device busy. At most one
        job per core: a window of reads tends to land at once, and a job per
        object would make them all finish together, the consumer's first
        object among the last."""
        with self._cond:
            for ir in reads:
                heapq.heappush(self._to_verify, ir)
            self._verifying += len(reads)
            start = min(len(reads), self._max_verifiers - self._verifiers)
            self._verifiers += start
        for _ in range(start):
            try:
                self._executor.submit(LOAD, self._verify_queued)
            except RuntimeError:  # the tier is closing: verify here
                self._verify_queued()

    def _verify_queued(self) -> None:
        """Verify landed reads, lowest index first, until none is queued.
        One the consumer will not take is given up unverified."""
        while True:
            with self._cond:
                if not self._to_verify:
                    self._verifiers -= 1
                    return
                i, r = heapq.heappop(self._to_verify)
                wanted = i <= self._end and (self._consumed is None or i < self._consumed)
            if wanted:
                try:
                    val = self._finish(self._keys[i], r.op, r.got(), r.t0, r.pool)
                except Exception as exc:
                    val = exc
                if self._into is not None and isinstance(val, ChunkObject):
                    val = self._deliver(i, val)
                self._set(i, val)
            else:
                r.op.abandon(r.pool)
            with self._cond:
                self._verifying -= 1
                self._cond.notify_all()

    def _deliver(self, i: int, obj: ChunkObject) -> ChunkObject | None:
        """Copy verified ``obj``'s payload into the caller's buffer ``i``
        (on the verification job), unless the consumer will not take it.
        None (a miss: the stream ends there) where no buffer of the payload's
        size waits for it. A copy is registered under the lock and ``stop``
        waits for the copies under way: once the consumer stopped, nothing
        writes into its buffers. An object read in its lent slot is there
        already."""
        if self._lent and i < len(self._into) and obj.header.payload_len == self._into.payload_bytes \
                and self._into.lender(i).holds(obj.buf):
            return obj
        dst = slot(self._into, i, obj.header.payload_len)
        if dst is None:
            obj.release()
            return None
        with self._cond:
            if i > self._end or (self._consumed is not None and i >= self._consumed):
                return obj  # nobody takes it (``_set`` releases it): not copied
            self._copying += 1
        try:
            copy_into(dst, obj.payload)
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()
        return obj

    def _submit(self, ctx: AioContext, backlog: list) -> bool:
        """Hand the backlog to the kernel; False if it kept some back (it is
        short of requests: they go again once reads in flight landed)."""
        if not backlog:
            return True
        try:
            took = ctx.submit(backlog)
        except OSError:
            if not ctx.inflight:
                raise
            took = 0
        if self._obs is not None and took:
            self._obs.reads_submitted(self._source, took)
        del backlog[:took]
        return not backlog

    def _sync(self, i: int) -> object:
        """Read object ``i`` the ordinary way (on the driver), and copy it
        into the caller's buffer like a verified AIO read."""
        try:
            val = self._read_sync(self._keys[i])
        except Exception as exc:
            return exc
        if self._into is not None and isinstance(val, ChunkObject):
            val = self._deliver(i, val)
        return val

    def _set(self, i: int, val: object) -> None:
        """Publish index ``i``'s result: an object, None (miss) or an error.
        What nobody will take is released here."""
        with self._cond:
            if val is None or isinstance(val, BaseException):
                self._end = min(self._end, i)
            unwanted = i > self._end or (self._consumed is not None and i >= self._consumed)
            if not unwanted:
                self._results[i] = val
                self._cond.notify_all()
        if unwanted and isinstance(val, ChunkObject):
            val.release()

    # ------------------------------------------------------------ consumer
    def stop(self, consumed: int = 0) -> None:
        """Stop submitting; release objects read but not handed out (reads
        still in flight are released by the driver as they land); return
        once no copy into the caller's buffers is under way. The first call
        runs the ``done`` hook."""
        with self._cond:
            self._consumed = consumed if self._consumed is None else min(self._consumed, consumed)
            drop = [v for i, v in self._results.items() if i >= self._consumed]
            for i in [i for i in self._results if i >= self._consumed]:
                del self._results[i]
            while self._copying:  # a copy into the caller's buffers is a memcpy: it ends promptly
                self._cond.wait()
            done, self._done_hook = self._done_hook, None
        self._job.cancel()
        for v in drop:
            if isinstance(v, ChunkObject):
                v.release()
        if done is not None:
            done()

    def iter(self, timeout: float | None) -> Iterator[ChunkObject]:
        """Yield objects in key order. Each yielded object is handed over with
        its reference: the consumer releases it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handed = 0
        try:
            for i in range(len(self._keys)):
                with self._cond:
                    while i not in self._results and not ((self._done and not self._verifying) or i > self._end):
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            self.failed = FutureTimeout()
                            return
                        self._cond.wait(remaining)
                    val = self._results.pop(i, _ABSENT)
                    crash = self._crash
                if val is _ABSENT and crash is not None:
                    self.failed = crash
                    return
                if val is _ABSENT or val is None:
                    return
                if isinstance(val, BaseException):
                    self.failed = val
                    return
                handed = i + 1
                yield val  # type: ignore[misc]
        finally:
            self.stop(consumed=handed)


class _Read:
    """One object's read in flight: its pieces' results as they land."""

    __slots__ = ("op", "pool", "est", "t0", "piece", "left", "results")

    def __init__(self, op: OpenRead, pool, est: int, t0: float, piece: int, pieces: int):
        self.op, self.pool, self.est, self.t0, self.piece, self.left = op, pool, est, t0, piece, pieces
        self.results: dict[int, int] = {}

    def got(self) -> int:
        """Bytes read from the start of the file without a gap (a short piece
        is the end of the file: what follows it counts for nothing)."""
        got = 0
        for j in range(len(self.results)):
            got += self.results[j]
            if self.results[j] < min(self.piece, len(self.op.buf) - j * self.piece):
                break
        return got


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the reads that fill a buffer of ``nbytes``."""
    return [(off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]
