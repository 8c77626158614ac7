"""Page-aligned host buffers and a GIL-free copy.

Buffers come from anonymous ``mmap`` so they are 4 KiB aligned, which is what
O_DIRECT needs. A buffer lives as long as any memoryview of it does.

Read buffers of 2 MiB or more may sit on transparent huge pages
(``huge=True``): a mapping of exactly the buffer's length, starting on a
2 MiB boundary, advised ``MADV_HUGEPAGE``. Why: an O_DIRECT read is cut
into block requests of at most the device's ``max_segments`` physical
segments (254 on virtio-blk, 127 or fewer on many NVMe drives), and a
buffer of scattered 4 KiB pages makes each page a segment: a 3 MiB object
went to the disk as requests of 0.5-1.3 MiB. Each 2 MiB huge page is one
segment, so a 3 MiB object goes as one or two requests, and the kernel pins
a huge page for the I/O at the cost of one 4 KiB page (docs/benchmarks.md).
The mapping is exact, so no memory is spent beyond the buffer: the tail
that does not fill a huge page stays on 4 KiB pages (khugepaged only
collapses 2 MiB ranges that lie wholly inside a mapping).

That tail still costs a request: a 0.5B model's object (3 MiB + 4 KiB) is
one huge page and 257 small ones, over 254 segments, so it goes as two
requests (2 + 1 MiB), and in a probe such reads ran at 1.7-1.9 GB/s where
whole-object requests ran at 2.5 (docs/benchmarks.md). ``whole=True`` maps
whole huge pages (3 MiB + 4 KiB in 4 MiB): one request per object, at up to
a third more memory per buffer. ``BufferPool`` gives such buffers only to O_DIRECT
reads of a store where no tier keeps the buffers it is handed (a
process-local memory tier would hold them for long), and counts them at
their whole size.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
import weakref

ALIGN = 4096
HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def alloc(nbytes: int, populate: bool = False, huge: bool = False, whole: bool = False) -> memoryview:
    """A zero-filled, page-aligned, writable buffer of exactly ``nbytes``.

    ``populate`` faults every page in at once (MAP_POPULATE), cheaper than one
    fault per page later when the buffer is about to be filled anyway.
    ``huge``: on transparent huge pages where the kernel offers them and the
    buffer spans one (see the module's note); 4 KiB pages otherwise.
    ``whole``: with ``huge``, mapped in whole huge pages (the length rounded
    up to 2 MiB), so that no part of it sits on 4 KiB pages.
    """
    if nbytes <= 0:
        return memoryview(bytearray(0))
    if huge and nbytes >= HUGE and _thp.usable:
        buf = _alloc_huge(nbytes, populate, whole)
        if buf is not None:
            return buf
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    mm = mmap.mmap(-1, align_up(nbytes), flags=flags)
    return memoryview(mm)[:nbytes]


class _Thp:
    """Whether huge-page buffers can be made here: Linux with THP not set to
    ``never``, and the calls answering. Set off for good by the first
    refusal that will not change (logged by nobody: the buffers still work,
    on 4 KiB pages)."""

    def __init__(self):
        self.usable = _libc is not None and _thp_mode() != "never"


def _thp_mode() -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled
    ("always", "madvise", "never"), or "never" where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):  # not a libc with these calls
    _libc = None
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault the range in, writable, in one call
_thp = _Thp()


def _alloc_huge(nbytes: int, populate: bool, whole: bool) -> memoryview | None:
    """``nbytes`` (rounded up to 4 KiB, or to 2 MiB if ``whole``) mapped
    alone, starting on a 2 MiB boundary, advised MADV_HUGEPAGE before any
    page is touched; None if a call refused (the caller maps it the ordinary
    way). Unmapped when the last memoryview of it goes."""
    length = align_up(nbytes, HUGE if whole else ALIGN)
    span = length + HUGE
    raw = _libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == _MAP_FAILED:
        return None
    start = align_up(raw, HUGE)
    # Trim the slack so that the mapping is exactly the buffer: a huge page
    # is then only ever made of the buffer's own bytes.
    if start > raw:
        _libc.munmap(raw, start - raw)
    if raw + span > start + length:
        _libc.munmap(start + length, raw + span - (start + length))
    if _libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # a kernel built without THP
            _thp.usable = False
        _libc.munmap(start, length)
        return None
    if populate and _libc.madvise(start, length, _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(start, 0, length)  # an older kernel: fault each page in by writing it
    arr = (ctypes.c_char * length).from_address(start)
    # Not at exit: a thread still copying out of it then would fault, and
    # the process's end unmaps everything anyway.
    weakref.finalize(arr, _libc.munmap, start, length).atexit = False
    return memoryview(arr).cast("B")[:nbytes]


class BufferPool:
    """Recycles aligned buffers by size, up to ``max_bytes`` of mappings kept.

    Fresh anonymous memory costs a page fault and a page of zeroing per 4 KiB
    (about as much CPU as the read itself on a small host); recycled buffers
    cost nothing. ``put`` must only be given a buffer nobody else still uses:
    ``ChunkObject``'s reference count decides that.
    """

    def __init__(self, max_bytes: int = 256 << 20, huge: bool = True, whole_reads: bool = False):
        """``huge``: buffers of 2 MiB or more on transparent huge pages
        (``alloc``). ``whole_reads``: those for O_DIRECT reads in whole huge
        pages (``get(direct_read=True)``); the store that owns the pool turns
        it on when none of its tiers keeps the buffers it is handed."""
        self.max_bytes = max_bytes
        self.huge = huge
        self.whole_reads = whole_reads
        self._lock = threading.Lock()
        self._free: dict[tuple[int, int], list[memoryview]] = {}  # (length, mapping length) -> buffers
        self._kept = 0  # bytes of mappings kept
        self.allocated = 0  # fresh allocations, for tests and tuning
        self.reused = 0

    def get(self, nbytes: int, direct_read: bool = False) -> memoryview:
        """A buffer of ``nbytes``: recycled, or fresh and faulted in.
        ``direct_read``: it is for an O_DIRECT read (whole huge pages, where
        ``whole_reads``). A free buffer of the same length but the other
        mapping is taken rather than a fresh one: a fresh buffer costs a
        millisecond or more (4-5 ms for huge pages the kernel must first
        gather), a mapping not quite of the preferred kind costs little."""
        whole = direct_read and self.whole_reads and self.huge and nbytes >= HUGE and _thp.usable
        exact, rounded = (nbytes, align_up(nbytes)), (nbytes, align_up(nbytes, HUGE))
        with self._lock:
            for key in ((rounded, exact) if whole else (exact, rounded)):
                free = self._free.get(key)
                if free:
                    self._kept -= key[1]
                    self.reused += 1
                    return free.pop()
            self.allocated += 1
        return alloc(nbytes, populate=True, huge=self.huge, whole=whole)

    def put(self, buf: memoryview) -> None:
        """Keep ``buf`` for reuse if there is room. A buffer on huge pages
        (dearer to make again) may take the room of free ones on small pages."""
        key = (buf.nbytes, mapped_bytes(buf))
        with self._lock:
            if self._kept + key[1] > self.max_bytes and isinstance(buf.obj, ctypes.Array):
                for k in [k for k, v in self._free.items() if v and not isinstance(v[0].obj, ctypes.Array)]:
                    while self._free[k] and self._kept + key[1] > self.max_bytes:
                        self._free[k].pop()
                        self._kept -= k[1]
            if self._kept + key[1] <= self.max_bytes:
                self._free.setdefault(key, []).append(buf)
                self._kept += key[1]


def mapped_bytes(buf: memoryview) -> int:
    """Bytes of the mapping (or other object) a buffer is a view of."""
    try:
        return len(buf.obj)
    except TypeError:
        return buf.nbytes


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
