"""Changes to an object directory: objects published atomically (written
to ``tmp/``, then renamed into place; O_DIRECT where the tier writes so),
removed, stamped for recency and quarantined. Readers see no file or a
whole one."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Sequence

from kvtier.buffers import ALIGN, address
from kvtier.codec import ChunkObject
from kvtier.keys import ChunkKey
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.dir.layout import O_DIRECT, HOST, SUFFIX, Layout, remove_at
from kvtier.tiers.dir.stamps import LoadStamps

log = logging.getLogger(__name__)


class FileWrites(Layout):
    """The writes of ``ObjectDir``."""

    def write(self, obj: ChunkObject, key: ChunkKey, fsync: bool) -> None:
        """Publish ``obj`` atomically under ``key``'s name; with O_DIRECT
        (``direct_writes``) where its buffer allows (page-aligned, whole
        pages)."""
        w = self.begin_write(direct=_direct_writable(obj.buf))
        try:
            w.fill(obj, fsync)
            w.publish(key)
        except BaseException:
            w.abort()
            raise

    def refuse_direct_writes(self, why: str) -> None:
        """Write this directory buffered from now on: its file system
        refused an O_DIRECT write (logged once)."""
        if self.direct_writes:
            self.direct_writes = False
            log.warning("kvtier: %s under %s; writing it buffered from now on", why, self.root)

    def begin_write(self, size: int = 0, direct: bool = False) -> "PendingWrite":
        """A temp file in ``tmp/``, ``size`` bytes long from the start (a
        caller that accounts for writes in flight counts them by their temp
        files' sizes). Fill it, then publish it under a key, or abort it.
        ``direct``: opened with O_DIRECT, where this directory writes so
        (``direct_writes``) and its file system takes it."""
        tmp = f"{HOST}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        tdir = self._open_dir(("tmp",), create=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        direct = direct and self.direct_writes and bool(O_DIRECT)
        try:
            try:
                fd = os.open(tmp, flags | (O_DIRECT if direct else 0), 0o600, dir_fd=tdir)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self.refuse_direct_writes("the file system refused to open a file for O_DIRECT writes")
                direct = False
                fd = os.open(tmp, flags, 0o600, dir_fd=tdir)
            try:
                if size:
                    os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                remove_at(tdir, tmp)
                raise
        except BaseException:
            os.close(tdir)
            raise
        return PendingWrite(self, tdir, fd, tmp, direct)

    def unlink(self, key: ChunkKey) -> int:
        """Remove an object; returns the bytes freed (0 if it was not there)."""
        return self._unlink_at(*self._rel(key)) or 0

    def unlink_path(self, path: Path) -> int | None:
        """Remove a file found under ``base`` (by ``scan`` or an index);
        returns its size, or None if nothing was removed."""
        parts = path.relative_to(self.base).parts
        return self._unlink_at(parts[:-1], parts[-1])

    def _unlink_at(self, parts: Sequence[str], name: str) -> int | None:
        try:
            dfd = self._open_dir(parts)
        except OSError:
            return None  # gone, or a planted link: nothing of ours to remove
        try:
            size = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
            os.unlink(name, dir_fd=dfd)
            return size
        except FileNotFoundError:
            return None
        finally:
            os.close(dfd)

    def touch(self, key: ChunkKey, when: float) -> None:
        """Stamp an object's mtime (raises OSError if it is gone)."""
        parts, name = self._rel(key)
        dfd = self._open_dir(parts)
        try:
            os.utime(name, (when, when), dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)

    def stamp(self, key: ChunkKey, mtime: float, interval_s: float, op: "OpenRead | None" = None,
              later: LoadStamps | None = None) -> None:
        """Recency: stamp ``key``'s mtime now, unless its stamp (``mtime``)
        is younger than ``interval_s``; an object gone meanwhile is left be.
        ``op``: a read of the object, its file still open: stamped through
        it; by ``later``, the read's load, once its consumer is done, if
        given (it takes the file)."""
        now = time.time()
        if now - mtime < interval_s:
            return
        if op is not None and op.fd < 0:
            # The native read loop closed it: stamped since its load began
            # (``FileTier._stamped_since``), so not stamped again by it.
            return
        if op is not None and later is not None:
            later.add(op.take())
            return
        try:
            if op is not None:
                os.utime(op.fd, (now, now))
            else:
                self.touch(key, now)
        except OSError:
            pass

    def quarantine(self, key: ChunkKey) -> None:
        """Move a bad object aside so that nobody reads it again."""
        parts, name = self._rel(key)
        self._quarantine_at(parts, name)

    def quarantine_path(self, path: Path) -> None:
        """``quarantine`` for an object found by ``scan`` (its key unknown)."""
        parts = path.relative_to(self.base).parts
        self._quarantine_at(parts[:-1], parts[-1])

    def _quarantine_at(self, parts: Sequence[str], name: str) -> None:
        dst = f"{name[: -len(SUFFIX)]}.{int(time.time())}{SUFFIX}"
        try:
            src = self._open_dir(parts)
        except OSError:
            return  # gone, or a planted link: nothing of ours to move
        try:
            try:
                qdir = self._open_dir(("quarantine",), create=True)
            except OSError:
                remove_at(src, name)  # nowhere safe to keep it: remove it
                return
            try:
                os.rename(name, dst, src_dir_fd=src, dst_dir_fd=qdir)
            except FileNotFoundError:
                pass
            except OSError:
                remove_at(src, name)
            finally:
                os.close(qdir)
        finally:
            os.close(src)


class PendingWrite:
    """One object being written to ``tmp/`` (see ``ObjectDir.begin_write``).
    Owned by the thread that began it; ``publish`` or ``abort`` ends it."""

    def __init__(self, odir: FileWrites, tdir: int, fd: int, name: str, direct: bool = False):
        self._odir, self._tdir, self._fd, self.name = odir, tdir, fd, name
        self.direct = direct  # opened with O_DIRECT (until a write refused it)

    def fill(self, obj: ChunkObject, fsync: bool) -> None:
        view = obj.buf
        done = 0
        while done < view.nbytes:
            try:
                done += os.pwrite(self._fd, view[done:], done)
            except OSError as exc:
                # Some file systems open with O_DIRECT and refuse the write
                # (EINVAL), as some refuse the read: the rest goes buffered.
                # (After a short write the rest is off a page boundary: that
                # file alone goes on buffered.)
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                if done == 0:
                    self._odir.refuse_direct_writes("an O_DIRECT write failed (EINVAL)")
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
        if fsync:
            os.fsync(self._fd)

    def publish(self, key: ChunkKey) -> None:
        """Rename into place: readers see the whole object from now on."""
        self._close_fd()
        parts, name = self._odir._rel(key)
        ddir = self._odir._open_dir(parts, create=True)
        try:
            os.rename(self.name, name, src_dir_fd=self._tdir, dst_dir_fd=ddir)
        finally:
            os.close(ddir)
        os.close(self._tdir)
        self._tdir = -1

    def abort(self) -> None:
        self._close_fd()
        if self._tdir >= 0:
            remove_at(self._tdir, self.name)
            os.close(self._tdir)
            self._tdir = -1

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _direct_writable(buf: memoryview) -> bool:
    """Whether an O_DIRECT write can take ``buf`` as it is: whole pages from
    a page boundary (a read-only buffer's address is not asked: written
    buffered)."""
    if buf.nbytes == 0 or buf.nbytes % ALIGN:
        return False
    try:
        return address(buf) % ALIGN == 0
    except TypeError:
        return False
