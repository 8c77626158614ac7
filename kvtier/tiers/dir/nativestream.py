"""``NativeStream``: a directory tier's O_DIRECT load through the native read
loop (``kvtier._readloop``, kvtier/_native/readloop.c), where it was built.

One call on one pool thread opens, reads and checks the load's objects
without the GIL; the consumer waits for each object without it too, and
turns it into a ``ChunkObject`` with the tier's own ``finish`` (the header
parsed and checked by ``codec.decode``, the payload's checksum already
compared by the loop). Nothing is handed between Python threads per
object: the Python driver (``AioStream``) costs a wake-up and a GIL
hand-off from driver to verification job to consumer for each object, a
large part of a cold load's CPU (docs/benchmarks.md).

It answers to the same calls as ``AioStream`` (``iter``, ``stop``,
``failed``, ``delivers``, ``path``), with the same rules: reads land in
buffers the stream took (the tier's pool, or the slots of lent
``LoadBuffers``), never in the caller's own; the stream stops at the first
miss; what was read and not handed over goes back once the loop is done
with it.

What the loop does not settle, Python does the ordinary way: an object the
loop could not open with O_DIRECT, of a size other than expected, whose
read failed or whose checksum did not match, is read again by the tier's
``read_sync`` on the tier's pool, which tells a miss (None), a corrupt
object (quarantined, None) and an error apart like every other read.

Buffers: with lent ``LoadBuffers``, each slot's buffer from the start; else
buffers of the size the tier expects (``sizes``) from its pool, for the
objects the window may hold plus two, and one more each time the consumer
takes one: memory stays within the window and what the consumer holds, as
with ``AioStream``.

Threads: the loop runs as one LOAD job on the tier's ``PriorityExecutor``;
the consumer's thread iterates; ``stop`` may come from any.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterator, Sequence

from kvtier.buffers import LoadBuffers, copy_into, slot
from kvtier.codec import CHECKSUM_AT, CRC_AT, HEADER_STRUCT_SIZE, ChunkObject, Header, expected_head, expected_header
from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier import observe
from kvtier.keys import ChunkKey
from kvtier.tiers.dir.aio import ContextPool
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.readstream import MIN_INFLIGHT

log = logging.getLogger(__name__)

try:  # built by ``pip install`` where a C compiler is at hand (setup.py)
    from kvtier import _readloop
except ImportError:  # pragma: no cover - a build without the extension
    _readloop = None
# A loop built for another object format (a stale build in a source tree)
# would judge headers by the wrong offsets: it is not used.
if _readloop is not None and (getattr(_readloop, "HEADER_STRUCT_SIZE", None), getattr(_readloop, "HEAD_EXPECTED", None),
                              getattr(_readloop, "HEAD_CRC_AT", None)) != (HEADER_STRUCT_SIZE, CHECKSUM_AT, CRC_AT):
    logging.getLogger(__name__).warning("kvtier._readloop was built for another object format and is not used; "
                                        "rebuild it (pip install -e .)")
    _readloop = None

_POLL_S = 0.05  # how often the loop looks whether the consumer stopped, as AioStream's driver
_TAPER = 0.75  # as AioStream's: of what has not landed yet, at most this much in flight
_PIECE = 4 << 20  # objects larger than this are read as several requests (as AioStream)
_OBSERVED_WAIT_S = 5.0  # how long an observed load's end waits for the loop's events (observe.py)
_hash_set = False


def _xxh3_128_address() -> int | None:
    """The address of XXH3-128 in the ``xxhash`` package's own library (the
    one ``codec.payload_checksum`` runs; its dispatching entry picks the
    CPU's widest vector unit), or None."""
    try:
        import xxhash._xxhash as lib_module

        lib = ctypes.CDLL(lib_module.__file__)
    except (ImportError, OSError, AttributeError):
        return None
    for name in ("XXH3_128bits_dispatch", "XXH3_128bits"):
        fn = getattr(lib, name, None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def available() -> bool:
    """Whether the native read loop is here (built, and its checksum found)."""
    global _hash_set
    if _readloop is None:
        return False
    if not _hash_set:
        addr = _xxh3_128_address()
        if addr is None:
            return False
        _readloop.set_hash(addr)
        _hash_set = True
    return True


def new_load(paths: Sequence[bytes], sizes: Sequence[int], ctx, window_bytes: int, piece_bytes: int = _PIECE,
             trace: bool = False, expect: list | None = None, close_fresh: float = math.nan):
    """One native read loop's load (``_readloop.Load``) of ``paths`` below a
    folder, objects of ``sizes`` bytes, on AIO context ``ctx``, with the
    loop's pacing (taper, two objects in flight at least, how often it
    looks whether its consumer stopped) as every load has it: what
    ``NativeStream`` drives, and what ``kvtier bench storage`` times alone."""
    return _readloop.Load(list(paths), list(sizes), ctx.id, ctx.depth, window_bytes, _TAPER, MIN_INFLIGHT,
                          piece_bytes, _POLL_S, trace, expect, close_fresh)


class NativeStream:
    """Reads ``keys`` (``paths``: their objects' paths below the store's
    folder, as bytes, whose descriptor ``base()`` opens on the loop's
    thread; ``sizes``: the object lengths expected) with the native loop;
    yields the verified objects in key order, stopping at the first miss.

    ``finish(key, op, got, t0, pool)`` makes the object from a read the
    loop checked (``OpenRead`` with the loop's descriptor; None if it failed
    verification), ``read_sync(key)`` reads one object the ordinary way,
    ``refused()`` is called if the kernel refused an AIO read (the tier's
    next loads read the ordinary way), ``piece_bytes``: objects larger are
    read as several requests of about one size, ``ended()`` once the loop is done
    (the folder may be closed then), ``done()`` once the consumer is done
    (the first ``stop``; must not block), ``timed(opening_s, active_s)``
    once the loop is done, as ``AioStream``'s. ``layouts``: per key, the
    payload layout (dtype, shape, length) its header is expected to give, or
    None; the loop marks an object whose header is exactly the one expected
    (``codec.expected_head``, and a matching CRC-32), and
    ``finish_exact(key, op, header, t0, pool)`` makes it without parsing
    (``finish`` makes all others). ``close_fresh``: the loop closes the file
    of each verified object whose mtime is at least this (one that owes no
    recency stamp through its file; NaN: none), and ``finish`` gets an
    ``OpenRead`` without a descriptor (``fd`` -1) for it."""

    def __init__(
        self,
        executor: PriorityExecutor,
        keys: Sequence[ChunkKey],
        paths: Sequence[bytes],
        sizes: Sequence[int],
        base: Callable[[], int],
        finish: Callable[[ChunkKey, OpenRead, int, float, object], ChunkObject | None],
        read_sync: Callable[[ChunkKey], ChunkObject | None],
        pool,
        window_bytes: int,
        contexts: ContextPool,
        into: LoadBuffers | None = None,
        path: str = "",
        refused: Callable[[], None] = lambda: None,
        ended: Callable[[], None] = lambda: None,
        done: Callable[[], None] = lambda: None,
        timed: Callable[[float, float], None] = lambda opening_s, active_s: None,
        source: object = None,
        piece_bytes: int = _PIECE,
        layouts: Sequence[tuple | None] | None = None,
        finish_exact: Callable[[ChunkKey, OpenRead, Header, float, object], ChunkObject] | None = None,
        close_fresh: float = math.nan,
    ):
        if not available():
            raise RuntimeError("kvtier's native read loop is not built here")
        if into is not None and not isinstance(into, LoadBuffers):
            raise TypeError("NativeStream reads into the tier's pool or lent LoadBuffers only")
        self.path = path
        self.delivers = into is not None
        self.failed: BaseException | None = None
        self._keys, self._sizes, self._into = keys, sizes, into
        self._finish, self._read_sync, self._pool = finish, read_sync, pool
        self._finish_exact = finish_exact
        self._layouts = layouts if finish_exact is not None else None
        expect = None
        if self._layouts is not None:
            expect = [None if lay is None else expected_head(k, *lay) for k, lay in zip(keys, self._layouts)]
        self._refused, self._ended, self._timed = refused, ended, timed
        # Told the loop's reads, as ``source`` (the tier), once the loop is
        # done: the observer a benchmark installed, None in service.
        self._obs, self._source = observe.observed(source), source
        self._done_hook: Callable[[], None] | None = done
        self._executor = executor
        self._contexts = contexts
        self._lock = threading.Lock()
        self._bufs: list[tuple[memoryview, object] | None] = [None] * len(keys)  # given: (buffer, its pool)
        self._taken = [False] * len(keys)  # handed to ``finish``: its buffer and descriptor are the object's
        self._consumer_done = self._loop_done = self._cleaned = False
        self._crash: BaseException | None = None
        self._loop_end = threading.Event()
        self._load = None  # made below (it takes the AIO context)
        self._ctx = contexts.take()
        try:
            self._load = new_load(paths, sizes, self._ctx, window_bytes, piece_bytes, self._obs is not None, expect,
                                  close_fresh)
            # Buffers ahead of the consumer: what the window holds, plus two.
            per = max(1, min(sizes)) if sizes else 1
            self._ahead = len(keys) if into is not None else max(MIN_INFLIGHT, -(-window_bytes // per)) + 2
            self._given = 0
            self._give_upto(self._ahead)
        except BaseException:
            self._contexts.give(self._ctx)
            self._return_buffers()
            raise
        self._base = base
        try:
            self._job = executor.submit(LOAD, self._drive)
        except RuntimeError:  # the tier is closing: nothing was read
            self._contexts.give(self._ctx)
            self._return_buffers()
            raise

    # ------------------------------------------------------------ buffers
    def _pool_for(self, i: int):
        return self._into.lender(i) if self._into is not None else self._pool

    def _give_upto(self, n: int) -> None:
        """Give objects up to index ``n`` (exclusive) their buffers, in one
        call to the loop."""
        n, first = min(n, len(self._keys)), self._given
        if n <= first:
            return
        for i in range(first, n):
            pool = self._pool_for(i)
            buf = pool.get(self._sizes[i], direct_read=True)
            with self._lock:
                self._bufs[i] = (buf, pool)  # returned from here on, whatever happens next
        self._load.give(first, [b for b, _ in self._bufs[first:n]])
        self._given = n

    def _return_buffers(self) -> None:
        """Back to their pools: every buffer not handed to ``finish``, and
        every descriptor the loop left open (once the loop is done)."""
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
            bufs = [(i, b) for i, b in enumerate(self._bufs) if b is not None and not self._taken[i]]
        for i, (buf, pool) in bufs:
            fd = self._load.item(i)[2] if self._load is not None else -1
            if fd >= 0:
                os.close(fd)
            pool.put(buf)

    def _settle(self) -> None:
        """Once the loop and the consumer are both done: buffers back."""
        with self._lock:
            ready = self._loop_done and self._consumer_done
        if ready:
            self._return_buffers()

    # ------------------------------------------------------------ loop
    def _drive(self) -> None:
        try:
            # Opened here, not by the consumer: on a hung mount the open
            # blocks, and only the loop's thread may wait for the kernel.
            try:
                fd = self._base()
            except OSError as exc:  # backend trouble: the load fails with it
                self._crash, fd = exc, -1
            self._load.run(fd)
        except BaseException as exc:  # unexpected: the stream ends where the consumer is
            log.warning("kvtier: a native read loop failed: %s", exc)
            self._crash = exc
        finally:
            opening_s, active_s, refused, broken = self._load.times()
            if broken and self._crash is None:  # the loop could not reap: what it did not read fails the load
                self._crash = OSError("io_getevents failed in the native read loop")
            if self._obs is not None:
                for t, delta in self._load.events():
                    if delta > 0:
                        self._obs.reads_submitted(self._source, delta, t)
                    elif delta < 0:
                        self._obs.reads_landed(self._source, -delta, t)
            self._contexts.give(self._ctx)  # the loop drained it
            if refused:
                self._refused()
            self._ended()
            if active_s > 0:
                self._timed(opening_s, active_s)
            with self._lock:
                self._loop_done = True
            self._loop_end.set()
            self._settle()

    # ------------------------------------------------------------ consumer
    def stop(self, consumed: int = 0) -> None:
        """Read nothing more from index ``consumed`` on; buffers not handed
        over go back once the loop drained its reads. The first call runs
        the ``done`` hook."""
        self._load.stop(consumed)
        with self._lock:
            self._consumer_done = True
            done, self._done_hook = self._done_hook, None
        if self._job.cancel():  # the loop never started: nothing of it to wait for
            self._contexts.give(self._ctx)
            self._ended()
            with self._lock:
                self._loop_done = True
            self._loop_end.set()
        if done is not None:
            done()
        if self._obs is not None:
            # An observer reads its record once the load returned: the loop's
            # events are told once the loop drained its last reads.
            self._loop_end.wait(_OBSERVED_WAIT_S)
        self._settle()

    def iter(self, timeout: float | None) -> Iterator[ChunkObject]:
        """Yield objects in key order; each is handed over with its
        reference (the consumer releases it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handed = 0
        try:
            for i, key in enumerate(self._keys):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                state = self._load.wait(i, remaining)
                if state == _readloop.PENDING:
                    self.failed = FutureTimeout()
                    return
                if state == _readloop.OK:
                    val = self._accept(i, key)
                elif state == _readloop.FALLBACK:
                    val = self._ordinary(i, key, deadline)
                else:
                    # SKIPPED: the loop never read it. It had failed (the
                    # folder would not open), or it saw a miss before this
                    # one and read nothing past it: an object written again
                    # between the loop's open and the ordinary read of the
                    # miss (another process's) is served, and the load ends
                    # after it, as at a miss. (Whether it failed is known
                    # once its thread is done.)
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self.failed = self._crash if self._loop_end.wait(left) else FutureTimeout()
                    return
                if isinstance(val, BaseException):
                    self.failed = val
                    return
                if val is None:
                    return
                if self._into is not None:
                    val = self._deliver(i, val)
                    if val is None:
                        return
                handed = i + 1
                if self._given < len(self._keys):
                    self._give_upto(i + 1 + self._ahead)
                yield val
        finally:
            self.stop(consumed=handed)

    def _accept(self, i: int, key: ChunkKey) -> object:
        """The object the loop read and checked (the tier's ``finish``
        parses its header), or None, or the error."""
        _, _, fd, got, mtime, opened_s, t0, exact = self._load.item(i)
        buf, pool = self._bufs[i]
        # No lock: the buffers go back (``_return_buffers``) only once this
        # thread called ``stop``, after this.
        self._taken[i] = True
        op = OpenRead(fd, True, len(buf), buf, mtime, opened_s)
        try:
            if exact:
                header = expected_header(key, self._layouts[i], bytes(buf[CHECKSUM_AT:CRC_AT]))
                return self._finish_exact(key, op, header, t0, pool)
            return self._finish(key, op, got, t0, pool)
        except Exception as exc:
            return exc

    def _ordinary(self, i: int, key: ChunkKey, deadline: float | None) -> object:
        """Object ``i`` read the ordinary way on the tier's pool (the loop
        could not settle it), within the load's deadline."""
        try:
            fut = self._executor.submit(LOAD, self._read_sync, key)
        except RuntimeError as exc:  # the tier is closing
            return exc
        try:
            return fut.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            fut.add_done_callback(_release_result)
            return FutureTimeout()
        except Exception as exc:
            return exc

    def _deliver(self, i: int, obj: ChunkObject) -> ChunkObject | None:
        """Lent buffers: an object read in its slot is there already; one
        read the ordinary way is copied into the slot (None, the end of the
        load, where the slot is not of its size)."""
        if i < len(self._into) and self._into.lender(i).holds(obj.buf) \
                and obj.header.payload_len == self._into.payload_bytes:
            return obj
        dst = slot(self._into, i, obj.header.payload_len)
        if dst is None:
            obj.release()
            return None
        copy_into(dst, obj.payload)
        return obj


def _release_result(fut) -> None:
    """An ordinary read that ended after its load gave up on it."""
    try:
        obj = fut.result()
    except Exception:
        return
    if isinstance(obj, ChunkObject):
        obj.release()
