"""Linux native asynchronous I/O (``io_setup``/``io_submit``/``io_getevents``)
through ``ctypes`` system calls: what fio's ``libaio`` engine uses, with no
library to install.

Why: a thread per outstanding read costs thread wake-ups and GIL hand-offs
per object. With native AIO one thread keeps
dozens of O_DIRECT reads in flight on the device and reaps them in batches.

Native AIO is asynchronous only for O_DIRECT on file systems that support
it (ext4, XFS, block devices); elsewhere ``io_submit`` may run the read
before it returns. Callers therefore use it for O_DIRECT reads only, on a
thread that may block (``AioStream``'s driver), never on the consumer's.

Threads: an ``AioContext`` belongs to one thread at a time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading

IOCB_CMD_PREAD = 0

# System call numbers (asm-generic is arm64's and riscv's table).
_NR = {
    "x86_64": {"setup": 206, "destroy": 207, "getevents": 208, "submit": 209},
    "aarch64": {"setup": 0, "destroy": 1, "submit": 2, "getevents": 4},
    "riscv64": {"setup": 0, "destroy": 1, "submit": 2, "getevents": 4},
}.get(platform.machine())


class _Iocb(ctypes.Structure):
    # struct iocb (linux/aio_abi.h), little-endian field order.
    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


assert ctypes.sizeof(_Iocb) == 64 and ctypes.sizeof(_Event) == 32

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# Set once a context could not be made for a reason that will not change
# (no such call: an old kernel, gVisor, a seccomp filter): never try again.
_unavailable: str | None = None if _NR is not None else f"no system call table for {platform.machine()}"


def available() -> bool:
    return _unavailable is None and hasattr(os, "O_DIRECT")


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


class AioContext:
    """One kernel AIO context for up to ``depth`` reads in flight."""

    def __init__(self, depth: int):
        global _unavailable
        if not available():
            raise OSError(errno.ENOSYS, f"native AIO unavailable: {_unavailable}")
        self.depth = depth
        self._ctx = ctypes.c_ulong(0)
        ret = _syscall(ctypes.c_long(_NR["setup"]), ctypes.c_uint(depth), ctypes.byref(self._ctx))
        if ret < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM):
                _unavailable = os.strerror(err)
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self._iocbs = (_Iocb * depth)()
        self._ptrs = (ctypes.POINTER(_Iocb) * depth)()
        self._events = (_Event * depth)()
        self._free = list(range(depth))  # iocb slots not in flight
        self._slot_of: dict[int, int] = {}  # request id -> iocb slot
        self._closed = False

    @property
    def id(self) -> int:
        """The kernel's handle of this context (``aio_context_t``): for the
        native read loop, which submits and reaps on it itself, and leaves
        nothing in flight when it returns."""
        return self._ctx.value

    @property
    def room(self) -> int:
        return len(self._free)

    def submit(self, reqs: list[tuple[int, int, int, int, int]]) -> int:
        """Queue reads ``(request id, fd, buffer address, nbytes, offset)``.
        Returns how many the kernel took (the rest: submit again later);
        raises OSError if it took none."""
        if not reqs:
            return 0
        n = min(len(reqs), len(self._free))
        slots = [self._free.pop() for _ in range(n)]
        for j, (slot, (rid, fd, addr, nbytes, offset)) in enumerate(zip(slots, reqs)):
            cb = self._iocbs[slot]
            ctypes.memset(ctypes.byref(cb), 0, 64)
            cb.aio_data, cb.aio_lio_opcode, cb.aio_fildes = rid, IOCB_CMD_PREAD, fd
            cb.aio_buf, cb.aio_nbytes, cb.aio_offset = addr, nbytes, offset
            self._ptrs[j] = ctypes.pointer(cb)
        ret = _syscall(ctypes.c_long(_NR["submit"]), self._ctx, ctypes.c_long(n), self._ptrs)
        took = max(0, ret)
        for slot, (rid, *_rest) in zip(slots[:took], reqs):
            self._slot_of[rid] = slot
        self._free.extend(slots[took:])
        if ret < 0:
            _check(ret, "io_submit")
        return took

    def reap(self, min_nr: int, timeout_s: float | None) -> list[tuple[int, int]]:
        """Wait for at least ``min_nr`` completions (or ``timeout_s``):
        ``(request id, result)`` pairs, result the bytes read or -errno."""
        ts = None
        if timeout_s is not None:
            sec = int(timeout_s)
            ts = ctypes.byref(_Timespec(sec, int((timeout_s - sec) * 1e9)))
        while True:
            ret = _syscall(ctypes.c_long(_NR["getevents"]), self._ctx, ctypes.c_long(min_nr),
                           ctypes.c_long(self.depth), self._events, ts)
            if ret < 0 and ctypes.get_errno() == errno.EINTR:
                continue
            _check(ret, "io_getevents")
            break
        out = []
        for i in range(ret):
            ev = self._events[i]
            rid = int(ev.data)
            self._free.append(self._slot_of.pop(rid))
            out.append((rid, int(ev.res)))
        return out

    @property
    def inflight(self) -> int:
        return len(self._slot_of)

    def drain(self) -> None:
        """Wait for every read in flight (after this no buffer a read was
        given is written to any more, and no completion is left to reap)."""
        while self._slot_of:
            self.reap(1, None)

    def close(self) -> None:
        """``drain``, then free the context."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        _syscall(ctypes.c_long(_NR["destroy"]), self._ctx)


class ContextPool:
    """Contexts kept for the next loads: a load's driver takes one and gives
    it back drained. Making one per load costs an ``io_setup``, and freeing it
    an ``io_destroy``, which waits for an RCU grace period on the driver's
    pool thread. Thread-safe."""

    def __init__(self, depth: int = 256, keep: int = 4):
        self.depth, self.keep = depth, keep
        self._free: list[AioContext] = []
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()

    def take(self) -> AioContext:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's contexts are not its own
                self._free, self._pid = [], os.getpid()
            if self._free:
                return self._free.pop()
        return AioContext(self.depth)

    def give(self, ctx: AioContext) -> None:
        """Take ``ctx`` back once its reads landed (waits for them)."""
        ctx.drain()
        with self._lock:
            if not self._closed and len(self._free) < self.keep:
                self._free.append(ctx)
                return
        ctx.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for ctx in free:
            ctx.close()
