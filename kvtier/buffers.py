"""Page-aligned host buffers and a GIL-free copy.

Buffers come from anonymous ``mmap`` so they are 4 KiB aligned, which is what
O_DIRECT needs. A buffer lives as long as any memoryview of it does.
"""

from __future__ import annotations

import ctypes
import mmap

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def alloc(nbytes: int) -> memoryview:
    """A zero-filled, page-aligned, writable buffer of exactly ``nbytes``."""
    if nbytes <= 0:
        return memoryview(bytearray(0))
    mm = mmap.mmap(-1, align_up(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return memoryview(mm)[:nbytes]


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
