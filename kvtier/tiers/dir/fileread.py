"""Verified reads from an object directory: an object opened beneath the
store's folder (one ``openat2`` that follows no symlink where the kernel has
it, ``beneath``; else folder by folder with O_NOFOLLOW), its size checked,
read into a pooled buffer (O_DIRECT where the file system allows) and
decoded. ``open_read`` and ``finish_read`` are the two halves the AIO and
native drivers call around their own reads."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvtier.buffers import BufferPool, align_up
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD, ChunkObject, Header, decode, parse_header
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.dir import beneath
from kvtier.tiers.dir.layout import NOT_OURS, O_DIRECT, BaseHandle, Layout

log = logging.getLogger(__name__)

# Objects larger than this are trusted with an allocation of their size only
# after their header verified (real chunks are a few MiB to tens of MiB).
_CHECK_HEADER_FIRST = 16 << 20
# Buffered reads go in pieces this size: each small read returns as soon as
# its pages are in, while the kernel's readahead fetches the next ones, so
# the disk is kept busy and copying overlaps reading. One large read of a
# whole object waits for all of it (docs/benchmarks.md).
_BUFFERED_PIECE = 128 << 10


@dataclass
class OpenRead:
    """An object ``ObjectDir.open_read`` opened: its descriptor (O_DIRECT or
    not), the bytes to read, the pooled buffer they go into, the file's mtime."""

    fd: int
    direct: bool
    size: int
    buf: memoryview
    mtime: float
    opened_s: float = 0.0  # what opening and checking the file took (not the buffer)

    def close(self) -> None:
        """Close the file (after ``finish_read``), unless ``take`` took it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def take(self) -> int:
        """The file, now the caller's to close (``close`` leaves it open)."""
        fd, self.fd = self.fd, -1
        return fd

    def abandon(self, pool: BufferPool) -> None:
        """Give up the read: close the file, return the buffer (only once no
        read into it is in flight)."""
        self.close()
        pool.put(self.buf)


class FileReads(Layout):
    """The reads of ``ObjectDir``."""

    def read(self, key: ChunkKey, o_direct: bool, cold: bool, pool: BufferPool | None = None,
             accept: Callable[[ChunkObject, "OpenRead"], None] | None = None,
             base: BaseHandle | None = None) -> tuple[ChunkObject, float]:
        """Read and verify one object into a buffer from ``pool``. Returns it
        with the file's mtime. ``accept(obj, op)``, if given, is called once
        the object verified, before its file (``op``) is closed: a reader's
        recency stamp goes through the file it has open, not through its
        path walked again (or takes the file, ``op.take``, to stamp it
        later). ``base``: the store's folder as a load holds it open
        (``open_read``).

        Raises FileNotFoundError for a miss, CorruptObject for a bad object
        (a symlink, FIFO or other non-file where an object belongs included),
        OSError for I/O trouble. A file system that opens files with O_DIRECT
        but refuses the reads (EINVAL) is read buffered from then on.
        """
        pool = pool if pool is not None else BufferPool(0)
        direct = o_direct and self.direct_ok
        try:
            obj, op = self._read(key, direct, cold, pool, base)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not direct:
                raise
            self.refuse_direct(f"an O_DIRECT read failed ({exc.strerror})")
            obj, op = self._read(key, False, cold, pool, base)
        try:
            if accept is not None:
                accept(obj, op)
        except BaseException:
            obj.release()
            raise
        finally:
            op.close()
        return obj, op.mtime

    def refuse_direct(self, why: str) -> None:
        """Read this directory buffered from now on: its file system refused
        O_DIRECT I/O (logged once)."""
        if self.direct_ok:
            self.direct_ok = False
            log.warning("kvtier: %s under %s; reading it buffered from now on", why, self.root)

    def _read(self, key: ChunkKey, o_direct: bool, cold: bool, pool: BufferPool,
              base: BaseHandle | None = None) -> tuple[ChunkObject, "OpenRead"]:
        """The object, verified, and its file still open (``op.close``)."""
        op = self.open_read(key, o_direct, pool, base)
        got = 0
        try:
            if not op.direct:
                os.posix_fadvise(op.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while got < op.size:
                # O_DIRECT: one read to the aligned end of the buffer.
                end = len(op.buf) if op.direct else got + _BUFFERED_PIECE
                n = os.preadv(op.fd, [op.buf[got:end]], got)
                if n <= 0:
                    break
                got += n
            if cold and not op.direct:
                os.posix_fadvise(op.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            op.abandon(pool)
            raise
        try:
            return self.finish_read(key, op, got, pool), op
        except BaseException:
            op.close()
            raise

    def open_read(self, key: ChunkKey, o_direct: bool, pool: BufferPool, base: "BaseHandle | None" = None) -> "OpenRead":
        """The first half of ``read``: open ``key``'s object (O_DIRECT when
        asked and the file system allows), check its size and take a buffer
        for it. The caller fills ``buf[:size]`` (an O_DIRECT read may ask for
        all of ``buf``, whose length is aligned) and calls ``finish_read``,
        or ``abandon``. ``base``: the store's folder, held open by a load
        (``base_handle``); else opened here. Raises like ``read``."""
        t0 = time.perf_counter()
        parts, name = self._rel(key)
        fd, direct = self._open_object_beneath(parts, name, o_direct, base)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptObject("not a regular file")
            if st.st_size < HEADER_BLOCK or st.st_size > HEADER_BLOCK + MAX_PAYLOAD:
                raise CorruptObject(f"object size {st.st_size} out of range")
            size = st.st_size
            if size > _CHECK_HEADER_FIRST:
                # Large: believe the file's size only once its header (and
                # the key it echoes) checks out, so that a doubtful file never
                # costs an allocation and a read of its whole length.
                need = _header_first(fd, key, pool).object_len
                if size < need:
                    raise CorruptObject(f"truncated: {size} B, need {need}")
                size = need
            opened_s = time.perf_counter() - t0
            return OpenRead(fd, direct, size, pool.get(align_up(size), direct_read=direct), st.st_mtime, opened_s)
        except BaseException:
            os.close(fd)
            raise

    def finish_read(self, key: ChunkKey, op: "OpenRead", got: int, pool: BufferPool,
                    payload_checked: bool = False) -> ChunkObject:
        """The second half of ``read``: verify the ``got`` bytes read into
        ``op.buf`` (raises CorruptObject; the buffer goes back to ``pool``
        then). The file stays open (the caller's ``op.close``): a recency
        stamp may still go through it. ``payload_checked``: as ``decode``'s
        (the native read loop compared the payload's checksum)."""
        try:
            return decode(op.buf, key, got, pool, payload_checked)
        except BaseException:
            pool.put(op.buf)
            raise

    def _open_object_beneath(self, parts: Sequence[str], name: str, o_direct: bool,
                             base: "BaseHandle | None" = None) -> tuple[int, bool]:
        """Open ``base/parts.../name`` for reading, following no symlink
        below ``base``: in one ``openat2`` where the kernel has it (beneath.py),
        else folder by folder; from ``base``'s descriptor where given, else
        from the folder opened here. Raises CorruptObject for a symlink or a
        file where a folder or the object belongs."""
        own = base is None
        handle = self.base_handle() if own else base  # the folder is never created here (``_open_dir``)
        try:
            if not beneath.available():
                try:
                    dfd = self._open_below(handle.fd(), parts)
                except OSError as exc:
                    if exc.errno in NOT_OURS:
                        raise CorruptObject(f"a symlink or file where a folder belongs ({exc.strerror})") from None
                    raise
                try:
                    return self._open_object(dfd, name, o_direct)
                finally:
                    os.close(dfd)
            try:
                return self._open_object(handle.fd(), "/".join((*parts, name)), o_direct, beneath.open_beneath)
            except OSError as exc:
                if exc.errno in NOT_OURS:
                    raise CorruptObject(f"a symlink or file on the object's path ({exc.strerror})") from None
                raise
        finally:
            if own:
                handle.close()

    def _open_object(self, dfd: int, name: str, o_direct: bool,
                     open_at: Callable[[int, str, int], int] | None = None) -> tuple[int, bool]:
        """Open ``name`` under folder ``dfd`` with O_NOFOLLOW (O_DIRECT where
        asked and allowed); ``open_at(dfd, name, flags)`` opens (default: a
        plain ``openat``)."""
        what = "the object is a symlink" if open_at is None else "a symlink on the object's path"
        open_at = open_at or (lambda d, n, f: os.open(n, f, dir_fd=d))
        # O_NONBLOCK: a FIFO planted under an object's name must not block
        # the reader (it has no effect on regular files).
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            if o_direct and self.direct_ok and O_DIRECT:
                try:
                    return open_at(dfd, name, flags | O_DIRECT), True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                fd = open_at(dfd, name, flags)
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    self.direct_ok = False  # this file system refuses O_DIRECT
                return fd, False
            return open_at(dfd, name, flags), False
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptObject(what) from None
            raise

    def header_at(self, path: Path) -> Header:
        """The parsed header of the file ``scan`` found at ``path``, opened
        the way ``read`` opens objects (folder by folder, O_NOFOLLOW): how an
        offline check (``kvtier store verify``) learns the key to ``read`` it
        with. Raises like ``read``."""
        parts = path.relative_to(self.base).parts
        try:
            dfd = self._open_dir(parts[:-1])
        except OSError as exc:
            if exc.errno in NOT_OURS:
                raise CorruptObject(f"a symlink or file where a folder belongs ({exc.strerror})") from None
            raise
        try:
            fd = self._open_object(dfd, parts[-1], False)[0]
        finally:
            os.close(dfd)
        try:
            return parse_header(os.pread(fd, HEADER_BLOCK, 0))
        finally:
            os.close(fd)

    def exists(self, key: ChunkKey) -> bool:
        # A plain stat (one round trip on a network mount). It may follow a
        # planted folder link: that only answers "present"; the read refuses.
        try:
            return os.stat(self.path(key), follow_symlinks=False).st_size >= HEADER_BLOCK
        except OSError:
            return False


def _header_first(fd: int, key: ChunkKey, pool: BufferPool) -> Header:
    """Read and check an object's header block alone (raises CorruptObject)."""
    head = pool.get(HEADER_BLOCK)
    try:
        n = os.preadv(fd, [head], 0)
        header = parse_header(head[: max(0, n)])
    finally:
        pool.put(head)
    if not header.matches(key):
        raise CorruptObject("key, check, namespace or token count does not match the requested key")
    return header

