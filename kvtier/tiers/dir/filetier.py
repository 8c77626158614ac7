"""Base of the directory tiers (disk, shm, shared) and their common options:
objects in an ``ObjectDir``, read and checked on the tier's pool
(``PooledTier``), written atomically, circuit breaker and timeouts around
every backend call.

Threads: callers (any thread) submit jobs to this tier's own
``PriorityExecutor``; jobs run on its workers. Subclasses decide where an
object may live (``_admit``), remember accesses (``_touched``) and forget
removed objects (``_forget``).
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from kvtier.buffers import LoadBuffers, align_up
from kvtier.codec import HEADER_BLOCK, ChunkObject, Header, key_of, layout
from kvtier.configfields import opt, size_field
from kvtier.errors import ConfigError
from kvtier.concurrency.breaker import CircuitBreaker
from kvtier.concurrency.executor import DELETE, LOAD, PriorityExecutor
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.dir import aio, beneath, nativestream
from kvtier.tiers.dir.aiostream import AioStream
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.layout import BaseHandle
from kvtier.tiers.pooled import PooledTier
from kvtier.tiers.dir.readpath import BUFFERED, DIRECT, ReadPathChooser
from kvtier.tiers.readstream import ReadStream
from kvtier.tiers.dir.stamps import LoadStamps, Owed

log = logging.getLogger(__name__)
T = TypeVar("T")

# Where opening a file is a round trip (a network or FUSE mount), one AIO
# driver thread opens a load's objects one after the other, where pool
# threads open them side by side (docs/benchmarks.md). A load whose driver
# spent at least this share of its time opening objects, for this many
# loads in a row, each at least ``_SLOW_OPENS_MIN_S`` long, moves the tier
# to pool threads. On a local disk opening is a small part of a load.
_SLOW_OPENS_SHARE = 0.5
_SLOW_OPENS_LOADS = 3
_SLOW_OPENS_MIN_S = 0.005
# Namespaces whose bytes per token a tier remembers (``_native_sizes``): a
# handful of models and shards in practice; their layouts, per token count
# (whole chunks, and the last chunks of sessions).
_NAMESPACES_KEPT = 256
_LAYOUTS_KEPT = 4096


@dataclass(frozen=True)
class FileTierConfig:
    """Options common to directory tiers."""

    path: str = opt("", "directory for objects (required)")
    capacity: int = size_field(0, "bytes this tier may hold (required)")
    name: str = opt("", "tier name in metrics and logs (defaults to the kind)")
    o_direct: bool = opt(True, "read with O_DIRECT into aligned buffers (false: buffered reads with readahead; "
                         "`kvtier bench storage` measures both on your storage; file systems that refuse O_DIRECT "
                         "are read buffered anyway)")
    cold_reads: bool = opt(False, "drop each object from the page cache after reading it (benchmarks)")
    read_window_bytes: int = size_field(128 << 20, "bytes of reads in flight per load, two objects at least (in "
                                        "vLLM on this project's disk 16, 32 and 128 MiB showed no consistent "
                                        "difference; `kvtier bench storage` names the window that read at about "
                                        "the fastest rate for the least CPU in its loads on your storage)")
    io_threads: int = opt(16, "threads of this tier's I/O pool", ge=1)
    aio: bool = opt(True, "with o_direct: issue a load's reads with Linux native AIO, from the native read loop "
                    "(native_reads; it checks what it reads) or else one Python driver thread (each landed object "
                    "verified on the pool) (false: "
                    "one pool thread per blocking read; where the "
                    "kernel offers no AIO, threads are used anyway, and so they are once three loads in a row "
                    "spent most of their time opening files: each open a round trip, as on network and FUSE "
                    "mounts)")
    native_reads: bool = opt(True, "with aio: run a load's opens, reads and payload checksums in kvtier's native "
                             "read loop, without the GIL, where it was built (`pip install` builds it where a C "
                             "compiler is at hand; the metric kvtier_load_drivers_total says which driver read "
                             "each load); false: the Python driver")
    adaptive_reads: bool = opt(False, "with o_direct: read some loads buffered too, and read each load by whichever "
                               "path (O_DIRECT or buffered) this tier's recent loads read faster; one load in 16 "
                               "takes the other path to notice a change (measure it first: `kvtier bench storage "
                               "--read-modes auto,direct-aio,buffered`)")
    fsync: bool = opt(False, "fsync each object before publishing (checksums already catch torn data)")
    direct_writes: bool = opt(True, "write each object with O_DIRECT where its buffer is page-aligned: its blocks "
                              "are placed as it is written, each object's on its own aligned run, not packed "
                              "with others' at writeback (on this project's disk cold 2k loads of the same "
                              "objects read 3-18 % faster; docs/benchmarks.md); file systems that refuse it are "
                              "written buffered, with one warning")

    def validate(self, prefix: str = "") -> None:
        if not self.path:
            raise ConfigError(f"{prefix}path", "is required", "set the directory, e.g. path: /nvme/kvtier")
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set", "set how much this tier may hold, e.g. capacity: 500GiB")
        if self.io_threads <= 0:
            raise ConfigError(f"{prefix}io_threads", "must be positive", "use e.g. 16")
        if self.read_window_bytes <= 0:
            raise ConfigError(f"{prefix}read_window_bytes", "must be positive", "use e.g. 64MiB")



class FileTier(PooledTier):
    Config = FileTierConfig
    # Whether a load's recency stamps wait until its consumer is done
    # (stamps.py): where a stamp is a round trip to a shared mount.
    defer_stamps = False
    # Whether the folder is one many nodes use (it must exist; its owners and
    # modes are the operator's), not a node's private tier's (this user's
    # alone, made if missing): ``folders``.
    shared_folder = False

    def __init__(self, config: FileTierConfig, metrics=None, breaker: CircuitBreaker | None = None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.dir = ObjectDir(config.path, f"{self.name}.path", shared=self.shared_folder)
        self.dir.direct_writes = config.direct_writes
        self.executor = PriorityExecutor(self.name, config.io_threads, on_cpu=self.metrics.job_cpu)
        self._aio_contexts = aio.ContextPool()  # reused by the loads' AIO drivers
        self._aio_ok = True  # false once the kernel refused this directory's AIO reads, or opens were too slow
        self._slow_opens = 0  # AIO loads in a row whose driver spent most of its time opening files
        self.metrics.aio_reads(self.reads_with_aio)
        self._paths = ReadPathChooser()  # adaptive_reads: O_DIRECT or buffered, per load
        # Payload bytes of one token, per namespace (models, shards and KV
        # layouts differ), once an object of it was read or written here.
        self._payload_per_token: dict[bytes, int] = {}
        # The payload layout (dtype, shape, length) per namespace and token
        # count, from headers parsed here: the native read loop compares a
        # header with the one this layout gives instead of parsing it.
        self._layouts: dict[tuple[bytes, int], tuple[str, tuple[int, ...], int]] = {}
        self._owed = Owed()  # stamps loads handed over and not made yet (``defer_stamps``)

    # ------------------------------------------------------------ hooks
    def _admit(self, key: ChunkKey, obj: ChunkObject) -> bool:
        """Make room for ``obj``; False refuses the store (counted by caller)."""
        return True

    def _stored(self, key: ChunkKey, obj: ChunkObject) -> None:
        """``obj`` is now published."""

    def _unadmit(self, key: ChunkKey, obj: ChunkObject) -> None:
        """A store admitted by ``_admit`` failed."""

    def _touched(self, key: ChunkKey, mtime: float, op: OpenRead | None = None,
                 later: LoadStamps | None = None) -> None:
        """``key`` was just read (its file had ``mtime``; ``op``: the read,
        its file still open, where there is one; ``later``: its load's
        stamps, where they wait for the load's end)."""

    def _stamped_since(self) -> float:
        """Objects whose mtime is at least this (seconds since the epoch)
        owe no recency stamp through their file (``_touched`` would not use
        it): the native read loop closes their files as it verifies them.
        Here: none stamps through its file."""
        return -math.inf

    def _forget(self, key: ChunkKey) -> None:
        """``key`` is gone (deleted, missing or quarantined)."""

    def _exists(self, key: ChunkKey) -> bool:
        return self.dir.exists(key)

    def _quarantine(self, key: ChunkKey) -> None:
        """``key``'s object failed verification: move it aside."""
        self.dir.quarantine(key)
        self._forget(key)

    # ------------------------------------------------------------ contract
    def _read_one(self, key: ChunkKey, direct: bool | None = None, base: BaseHandle | None = None,
                  later: LoadStamps | None = None) -> ChunkObject | None:
        """Read one object on this thread: with O_DIRECT as configured, or as
        ``direct`` says; from ``base``, the store's folder as the load holds
        it open, if given; its recency stamp by ``later``, if given."""
        t0 = time.perf_counter()
        direct = self.config.o_direct if direct is None else direct
        # Accepted with its file still open: a recency stamp goes through it.
        read = self._judged(key, lambda: self.dir.read(key, direct, self.config.cold_reads, self.pool,
                                                       lambda obj, op: self._accepted(key, obj, op, t0, later),
                                                       base))
        return None if read is None else read[0]

    def _stream(self, keys: Sequence[ChunkKey], into: Sequence[memoryview] | None = None):
        # O_DIRECT reads go through native AIO: in the native read loop
        # where it was built and takes the load, else from the Python
        # driver's thread; the pool's threads read buffered files (AIO would
        # run those inline).
        direct = self.config.o_direct and self.dir.direct_ok
        path = self._paths.pick() if direct and self.config.adaptive_reads else (DIRECT if direct else BUFFERED)
        window, bpt = self.config.read_window_bytes, lambda: self._bytes_per_token
        base = self.dir.base_handle()  # the load's opens start from the store's folder, opened once
        later = LoadStamps(self._run_later, self._owed) if self.defer_stamps else None
        done = later.flush if later is not None else _nothing
        if path == DIRECT and self.config.aio and self._aio_ok and aio.available():
            sizes = self._native_sizes(keys, into)
            if sizes is not None:
                try:
                    stream = nativestream.NativeStream(
                        self.executor, keys, [self.dir.rel_path(k) for k in keys], sizes, base.fd,
                        functools.partial(self._finish_read, later=later, payload_checked=True),
                        functools.partial(self._read_one, later=later), self.pool, window, self._aio_contexts,
                        into=into, path=path, refused=self._refuse_aio, ended=base.close, done=done,
                        timed=self._aio_timed, source=self,
                        layouts=[self._layouts.get((k.ns, k.num_tokens)) for k in keys],
                        finish_exact=functools.partial(self._finish_exact, later=later),
                        close_fresh=self._stamped_since())
                    self.metrics.load_driver("native")
                    return stream
                except OSError as exc:  # no AIO context: the Python driver says why
                    log.debug("tier %s: native read loop not started (%s)", self.name, exc)
            self.metrics.load_driver("aio")
            return AioStream(self.executor, keys, functools.partial(self._begin_read, base=base),
                             functools.partial(self._finish_read, later=later),
                             functools.partial(self._read_one, base=base, later=later), self.pool, window, bpt,
                             refused=self._refuse_aio, path=path, contexts=self._aio_contexts, source=self,
                             into=into, ended=base.close, done=done, timed=self._aio_timed)
        read = functools.partial(self._read_one, direct=path == DIRECT, base=base, later=later)
        self.metrics.load_driver("threads")
        return ReadStream(self.executor, keys, read, window, bpt, path=path, ended=base.close, done=done)

    def _native_sizes(self, keys: Sequence[ChunkKey], into) -> list[int] | None:
        """The object lengths a load through the native read loop expects
        (its buffers' lengths), or None where that loop does not take the
        load: not built or switched off, no ``openat2``, a file system that
        refuses O_DIRECT, the caller's own buffers (copied into by the
        Python driver's verification jobs), or a namespace of which no
        object was read or written here yet (a token's bytes unknown)."""
        if not (self.config.native_reads and nativestream.available() and beneath.available() and self.dir.direct_ok):
            return None
        if isinstance(into, LoadBuffers):
            if len(into) < len(keys):
                return None
            return [HEADER_BLOCK + align_up(into.payload_bytes)] * len(keys)
        if into is not None:
            return None
        sizes = []
        for k in keys:
            per = self._payload_per_token.get(k.ns)
            if per is None:
                return None
            sizes.append(HEADER_BLOCK + align_up(k.num_tokens * per))
        return sizes

    def _learn_sizes(self, obj: ChunkObject) -> None:
        """What one token's payload takes, from an object read or written
        here: a load's object lengths (``_native_sizes``); and the layout
        its header gave, the one the next load expects (``_layouts``)."""
        per, rest = divmod(obj.header.payload_len, max(1, obj.header.num_tokens))
        if not rest and self._payload_per_token.get(obj.header.ns) != per:
            if len(self._payload_per_token) >= _NAMESPACES_KEPT:
                self._payload_per_token.clear()  # many namespaces: learn those in use again
            self._payload_per_token[obj.header.ns] = per
        at, lay = (obj.header.ns, obj.header.num_tokens), layout(obj.header)
        if self._layouts.get(at) != lay:  # the last header parsed is what the next load expects
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.clear()
            self._layouts[at] = lay

    def _run_later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this tier's pool (a load's stamps; RuntimeError once
        the tier is closing)."""
        self.executor.submit(LOAD, fn)

    def _streamed(self, stream, nbytes: int, seconds: float) -> None:
        # Measured whether or not the choice is adaptive: the rates are an
        # operator's view of the tier's read paths too.
        self.metrics.read_path(stream.path, self._paths.record(stream.path, nbytes, seconds))

    @property
    def reads_with_aio(self) -> bool:
        """Whether this tier's O_DIRECT loads go through native AIO (as
        configured, where the kernel has it, and not stopped since)."""
        return self._aio_ok and self.config.o_direct and self.config.aio and aio.available()

    def _refuse_aio(self) -> None:
        """The kernel refused an AIO read here: later loads use the pool's
        threads (logged once)."""
        self._stop_aio("the kernel refused native AIO reads")

    def _aio_timed(self, opening_s: float, active_s: float) -> None:
        """An AIO load's driver spent ``opening_s`` of its ``active_s``
        opening objects: after ``_SLOW_OPENS_LOADS`` loads in a row that
        spent most of their time opening, later loads use the pool's
        threads."""
        if active_s < _SLOW_OPENS_MIN_S:
            return  # too short to tell
        if opening_s < _SLOW_OPENS_SHARE * active_s:
            self._slow_opens = 0
            return
        self._slow_opens += 1
        if self._slow_opens >= _SLOW_OPENS_LOADS:
            self._stop_aio(f"AIO loads spent most of their time opening files, one at a time "
                           f"({opening_s / active_s:.0%} of a load's {active_s * 1e3:.0f} ms, "
                           f"{self._slow_opens} loads in a row)")

    def _stop_aio(self, why: str) -> None:
        """Later loads read with the pool's threads (logged once)."""
        if self._aio_ok:
            self._aio_ok = False
            self.metrics.aio_reads(False)
            log.warning("tier %s: %s under %s; reading with threads from now on", self.name, why, self.dir.root)

    def _begin_read(self, key: ChunkKey, pool=None, base: BaseHandle | None = None) -> OpenRead | None:
        """Open ``key`` for an AIO read into a buffer of ``pool`` (default:
        the tier's; a load into lent buffers passes its slot's), from
        ``base``, the store's folder as the load holds it open."""
        pool = self.pool if pool is None else pool
        return self._judged(key, lambda: self.dir.open_read(key, True, pool, base))

    def _finish_read(self, key: ChunkKey, op: OpenRead, got: int, t0: float, pool=None,
                     later: LoadStamps | None = None, payload_checked: bool = False) -> ChunkObject | None:
        pool = self.pool if pool is None else pool
        try:
            obj = self._judged(key, lambda: self.dir.finish_read(key, op, got, pool, payload_checked))
            if obj is not None:
                # A recency stamp goes through the file still open: one
                # ``futimens``, not its path walked again (on a network file
                # system, round trips); by the load once its consumer is
                # done, where ``later`` is given.
                self._accepted(key, obj, op, t0, later)
        finally:
            op.close()  # unless the stamp took it
        return obj

    def _finish_exact(self, key: ChunkKey, op: OpenRead, header: Header, t0: float, pool,
                      later: LoadStamps | None = None) -> ChunkObject:
        """``_finish_read`` of an object the native read loop verified whole:
        payload, padding, and a header equal to the one expected (``header``,
        from ``codec.expected_header``) with its CRC-32: nothing is left to
        parse, and this namespace's sizes and layout are known already."""
        obj = ChunkObject(header, op.buf, pool)
        try:
            self._read_done(key, obj, op, t0, later)
        finally:
            op.close()  # unless the stamp took it
        return obj

    def _judged(self, key: ChunkKey, read: Callable[[], T]) -> T | None:
        """``read()``, or None where it found no object (forgotten) or a bad
        one (quarantined and counted); other errors pass."""
        try:
            return read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except CorruptObject as exc:
            self._corrupt(key, exc)
            return None

    def _corrupt(self, key: ChunkKey, exc: CorruptObject) -> None:
        log.warning("tier %s: object %s failed verification (%s); quarantined", self.name, key.hex[:16], exc)
        self.metrics.corrupt()
        self._quarantine(key)

    def _accepted(self, key: ChunkKey, obj: ChunkObject, op: OpenRead, t0: float,
                  later: LoadStamps | None = None) -> None:
        self._learn_sizes(obj)
        self._read_done(key, obj, op, t0, later)

    def _read_done(self, key: ChunkKey, obj: ChunkObject, op: OpenRead, t0: float,
                   later: LoadStamps | None = None) -> None:
        """A verified read's accounting: the window's estimate of an
        object's bytes, the read's latency, the object's recency stamp."""
        self._bytes_per_token = max(1, obj.nbytes // max(1, obj.header.num_tokens))
        self.metrics.observe("read", time.perf_counter() - t0)
        self._touched(key, op.mtime, op, later)

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
        self._learn_sizes(obj)
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
        self._aio_contexts.close()


def _nothing() -> None:
    pass
