"""Page-aligned host buffers and a GIL-free copy.

Buffers come from anonymous ``mmap`` so they are 4 KiB aligned, which is what
O_DIRECT needs. A buffer lives as long as any memoryview of it does.

Read buffers of 2 MiB or more may sit on transparent huge pages
(``huge=True``): a mapping of exactly the buffer's length, starting on a
2 MiB boundary, advised ``MADV_HUGEPAGE``. Why: an O_DIRECT read is cut
into block requests of at most the device's ``max_segments`` physical
segments, and a buffer of scattered 4 KiB pages makes each page a segment,
so an object reaches the disk in pieces; a 2 MiB huge page is one segment,
pinned at the cost of one 4 KiB page (docs/tuning.md). The mapping is
exact, so no memory is spent beyond the buffer: the tail that does not fill
a huge page stays on 4 KiB pages (khugepaged only collapses 2 MiB ranges
that lie wholly inside a mapping).

That tail still costs a request of its own. ``whole=True`` maps whole huge
pages (3 MiB + 4 KiB in 4 MiB): one request per object, at up to a third
more memory per buffer. ``BufferPool`` gives such buffers only to O_DIRECT
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
from collections.abc import Sequence

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
        mapping is taken rather than a fresh one: a fresh buffer is faulted
        in (its huge pages gathered first), a mapping not quite of the
        preferred kind costs little."""
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


def slot(bufs: "Sequence[memoryview] | LoadBuffers | None", i: int, nbytes: int) -> memoryview | None:
    """Buffer ``i`` of ``bufs`` if there is one exactly ``nbytes`` long, else
    None: where a load copies the ``i``-th payload (a buffer of another size,
    or none, ends the load there)."""
    if bufs is None or i >= len(bufs):
        return None
    if isinstance(bufs, LoadBuffers):
        return bufs.writable(i) if bufs.payload_bytes == nbytes else None
    return bufs[i] if bufs[i].nbytes == nbytes else None


def load_views(bufs: "Sequence | LoadBuffers", n: int) -> "list[memoryview] | LoadBuffers":
    """The first ``n`` of a load's buffers as it fills them: lent ones as
    they are, the caller's own as unsigned-byte views."""
    if isinstance(bufs, LoadBuffers):
        return bufs[:n]
    return [memoryview(b).cast("B") for b in bufs[:n]]


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


class LoadBuffers:
    """Buffers kvtier lends a caller to load chunks into
    (``TieredStore.load_buffers``): one slot per chunk, each a whole object's
    buffer (the ``offset``-byte header block, then the payload), aligned for
    O_DIRECT. A directory tier's native-AIO read lands an object straight in
    its slot and is verified there, so a load into lent buffers copies
    nothing; other tiers' objects are copied into the slot's payload.

    ``payload(i)`` is slot ``i``'s payload, read-only to the caller: ask for
    it after each load (a slot may have a new buffer then). Like a load into
    the caller's own buffers, only the leading slots the load counted hold
    chunks; the others are undefined.

    Why lent and not the caller's own: a read still in flight when a load
    gives up (its deadline) lands later, and must not land in memory the
    caller uses again. A slot whose buffer someone else may still write or
    hold (a late read, or the memory tier that promoted the object in it) is
    busy: the next load gives that slot a fresh buffer, and the old one goes
    back to the pool when its last holder lets go.

    A slice (``bufs[a:b]``) is a view of the same slots. One load at a time
    into one set of slots (two at once are safe, but the slots then hold
    either's chunks).
    """

    __slots__ = ("payload_bytes", "_offset", "_object_bytes", "_pool", "_lock", "_bufs", "_busy", "_start", "_stop")

    def __init__(self, pool: "BufferPool", count: int, payload_bytes: int, offset: int = ALIGN):
        if payload_bytes <= 0 or count < 0:
            raise ValueError(f"{count} buffers of {payload_bytes} B: need a count of 0 or more and a positive payload size")
        self.payload_bytes = payload_bytes
        self._offset = offset
        self._object_bytes = offset + align_up(payload_bytes)
        self._pool = pool
        self._lock = threading.Lock()
        self._bufs = [pool.get(self._object_bytes, direct_read=True) for _ in range(count)]
        self._busy = [False] * count  # a read may land in it, or an object in it is held
        self._start, self._stop = 0, count

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, index: slice) -> "LoadBuffers":
        if not isinstance(index, slice):
            raise TypeError("LoadBuffers: slice it, or use payload(i)")
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("LoadBuffers: slices take consecutive slots")
        view = object.__new__(LoadBuffers)  # shares every slot (the lists and the lock)
        view.payload_bytes, view._offset, view._object_bytes = self.payload_bytes, self._offset, self._object_bytes
        view._pool, view._lock, view._bufs, view._busy = self._pool, self._lock, self._bufs, self._busy
        view._start, view._stop = self._start + start, self._start + max(start, stop)
        return view

    def payload(self, i: int) -> memoryview:
        """Slot ``i``'s payload (read-only)."""
        return self._view(self._slot(i)).toreadonly()

    def writable(self, i: int) -> memoryview:
        """Slot ``i``'s payload, to copy a chunk into (kvtier's loads): a busy
        slot gets a fresh buffer first."""
        j = self._slot(i)
        with self._lock:
            if self._busy[j]:
                self._replace(j)
            return self._view(j)

    def lender(self, i: int) -> "_Lender":
        """A pool for the read of slot ``i``'s chunk: it lends the slot's
        buffer to a read of an object of exactly that size."""
        return _Lender(self, self._slot(i))

    def _slot(self, i: int) -> int:
        if not 0 <= i < len(self):
            raise IndexError(f"slot {i} of {len(self)}")
        return self._start + i

    def _view(self, j: int) -> memoryview:
        return self._bufs[j][self._offset : self._offset + self.payload_bytes]

    def _replace(self, j: int) -> None:
        """Give slot ``j`` a fresh buffer (lock held); the old one stays
        with its holders and goes to the pool when they let go."""
        self._bufs[j] = self._pool.get(self._object_bytes, direct_read=True)
        self._busy[j] = False

    def _lend(self, j: int, nbytes: int) -> memoryview | None:
        with self._lock:
            if nbytes != self._bufs[j].nbytes:
                return None
            if self._busy[j]:
                self._replace(j)
            self._busy[j] = True
            return self._bufs[j]

    def _returned(self, j: int, buf: memoryview) -> bool:
        """``buf`` came back; True if it is slot ``j``'s (which is free
        again), False if the pool takes it."""
        with self._lock:
            if buf.obj is not self._bufs[j].obj:
                return False
            self._busy[j] = False
            return True


class _Lender:
    """The pool one slot's read takes its buffer from and gives it back to:
    the slot's own buffer for an object of its size, the store's pool for
    anything else (a header read first, an object of another size)."""

    __slots__ = ("_bufs", "_j")

    def __init__(self, bufs: LoadBuffers, j: int):
        self._bufs, self._j = bufs, j

    def get(self, nbytes: int, direct_read: bool = False) -> memoryview:
        buf = self._bufs._lend(self._j, nbytes)
        return buf if buf is not None else self._bufs._pool.get(nbytes, direct_read)

    def put(self, buf: memoryview) -> None:
        if not self._bufs._returned(self._j, buf):
            self._bufs._pool.put(buf)

    def holds(self, buf: memoryview) -> bool:
        """``buf`` is the slot's buffer (an object read in place)."""
        with self._bufs._lock:
            return buf.obj is self._bufs._bufs[self._j].obj
