"""Page-aligned host buffers and a GIL-free copy.

Buffers come from anonymous ``mmap`` so they are 4 KiB aligned, which is what
O_DIRECT needs. A buffer lives as long as any memoryview of it does.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def alloc(nbytes: int, populate: bool = False) -> memoryview:
    """A zero-filled, page-aligned, writable buffer of exactly ``nbytes``.

    ``populate`` faults every page in at once (MAP_POPULATE), cheaper than one
    fault per page later when the buffer is about to be filled anyway.
    """
    if nbytes <= 0:
        return memoryview(bytearray(0))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, align_up(nbytes), flags=flags)
    return memoryview(mm)[:nbytes]


class BufferPool:
    """Recycles aligned buffers by exact size, up to ``max_bytes`` kept.

    Fresh anonymous memory costs a page fault and a page of zeroing per 4 KiB
    (about as much CPU as the read itself on a small host); recycled buffers
    cost nothing. ``put`` must only be given a buffer nobody else still uses:
    ``ChunkObject``'s reference count decides that.
    """

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[memoryview]] = {}
        self._kept = 0
        self.allocated = 0  # fresh allocations, for tests and tuning
        self.reused = 0

    def get(self, nbytes: int) -> memoryview:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return alloc(nbytes, populate=True)

    def put(self, buf: memoryview) -> None:
        n = buf.nbytes
        with self._lock:
            if self._kept + n <= self.max_bytes:
                self._free.setdefault(n, []).append(buf)
                self._kept += n


def address(buf: memoryview) -> int:
    """Address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def copy_into(dst: memoryview, src: memoryview) -> None:
    """memcpy(dst, src) with the GIL released (ctypes foreign calls drop it).

    ``dst`` must be writable and exactly as long as ``src``.
    """
    n = src.nbytes
    if dst.nbytes != n:
        raise ValueError(f"buffer size mismatch: destination {dst.nbytes} B, source {n} B")
    if n == 0:
        return
    if src.readonly:
        ctypes.memmove(address(dst), bytes(src), n)
    else:
        ctypes.memmove(address(dst), address(src), n)
