"""The object directory: the on-disk layout the disk, node-memory and shared
tiers keep their objects in, atomic publication, verified reads, quarantine
and temp-file sweeping. Tiers read and write only through ``ObjectDir``.

Layout under the configured directory::

    kvtier-v1/objects/<ns:16 hex>/<key[0]:2 hex>/<key:64 hex>.kvc
    kvtier-v1/tmp/<host>.<pid>.<random>.tmp        writes in progress
    kvtier-v1/quarantine/<key>.<unix time>.kvc     objects that failed checks

Names hold only hex digests: no token, model or tenant text ever appears in a
path. Objects are published by ``rename`` from ``tmp/`` (same file system), so
a reader sees either no file or a complete one. Files are opened with
O_NOFOLLOW and created 0600 in 0700 directories, whose owners and modes are
checked as ``folders`` says (a node's private tiers: this user's alone).

Why one module of about 600 lines: it is one class (and the handle of a
write in progress) that owns every path operation a tier makes, each opening
folders one level at a time with O_NOFOLLOW (reads: the whole path in one
``openat2`` that follows no symlink, where the kernel has it, beneath.py);
kept together, that rule can be checked in one place.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvtier.buffers import ALIGN, BufferPool, address, align_up
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD, ChunkObject, Header, decode, parse_header
from kvtier.config import ConfigError
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.dir import beneath, folders
from kvtier.tiers.dir.stamps import LoadStamps


log = logging.getLogger(__name__)

LAYOUT_DIR = "kvtier-v1"
SUFFIX = ".kvc"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_NOT_OURS = (errno.ELOOP, errno.ENOTDIR)  # a symlink or a file where a folder belongs
# Objects larger than this are trusted with an allocation of their size only
# after their header verified (real chunks are a few MiB to tens of MiB).
_CHECK_HEADER_FIRST = 16 << 20
# Buffered reads go in pieces this size: each small read returns as soon as
# its pages are in, while the kernel's readahead fetches the next ones, so
# the disk is kept busy and copying overlaps reading. One large read of a
# whole object waits for all of it and was no faster than O_DIRECT on the
# virtio disk where this was measured (pieces: 1.5-1.7 GB/s; whole-object
# reads and O_DIRECT: 0.8-1.0 GB/s; docs/benchmarks.md).
_BUFFERED_PIECE = 128 << 10
# This host's name as it appears in temp and lease file names.
HOST = socket.gethostname().replace(".", "_")[:64] or "host"


@dataclass(frozen=True)
class ObjectEntry:
    path: Path
    key_hex: str
    ns_hex: str
    size: int
    mtime: float


class BaseHandle:
    """A store's folder, opened on first use and kept open until ``close``:
    the descriptor a load's object opens start from, so that each costs one
    ``openat2`` and not an open and a close of the folder around it. Held by
    one load, not by the tier: a descriptor held for the process's life
    would keep an unmounted file system busy, and would go on reading a
    folder that was replaced. Thread-safe (a load's reads on pool threads
    share it); ``close`` once none of them uses it any more."""

    __slots__ = ("path", "_fd", "_lock")

    def __init__(self, path: Path):
        self.path = path
        self._fd = -1
        self._lock = threading.Lock()

    def fd(self) -> int:
        """The folder's descriptor (raises as ``os.open`` would; tried again
        on the next call then)."""
        fd = self._fd
        if fd >= 0:
            return fd
        with self._lock:
            if self._fd < 0:
                self._fd = os.open(self.path, _DIR_FLAGS)
            return self._fd

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


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


class ObjectDir:
    """The directory layout and its file operations. Thread-safe; no state
    beyond paths and the O_DIRECT fallback flag."""

    def __init__(self, root: str | os.PathLike, config_key: str, create: bool = True, shared: bool = False):
        """``create``: make the layout if it is missing and check that it
        is writable (tiers). Without it nothing is created or written: the
        store must exist (administration commands that only look).
        ``shared``: a folder many nodes use (``folders``: it must exist, and
        its owners and modes are the operator's); else a node's private
        tier's, which must be this user's alone (a missing one is made)."""
        self.root = Path(root)
        self.base = self.root / LAYOUT_DIR
        self.objects = self.base / "objects"
        self.tmp = self.base / "tmp"
        self.quarantine_dir = self.base / "quarantine"
        self.key = config_key
        self.shared = shared
        self.direct_ok = True
        # Objects written with O_DIRECT where their buffers allow it: set by
        # the tier (its ``direct_writes``); off once the file system refused.
        self.direct_writes = False
        if not create:
            if not self.base.is_dir() or self.base.is_symlink():
                raise ConfigError(config_key, f"there is no kvtier store at {self.root} ({self.base} is missing)",
                                  "check the path; commands that only look never create a store")
            return
        try:
            folders.make_layout(self.root, (LAYOUT_DIR, ("objects", "tmp", "quarantine")), config_key, shared,
                                probe=f"{HOST}.{os.getpid()}.{secrets.token_hex(6)}.probe")
        except OSError as exc:
            raise ConfigError(
                config_key,
                f"directory {self.root} is not usable ({exc.strerror or exc})",
                "point it at a writable directory owned by this user",
            ) from None

    def open_private_file(self, name: str, flags: int) -> int:
        """Open (or create) the file ``name`` beside the objects
        (``kvtier-v1/NAME``: a lock, ledger or log of a private tier), this
        user's alone (``folders.open_private_file``)."""
        dfd = os.open(self.base, _DIR_FLAGS)
        try:
            return folders.open_private_file(dfd, self.base, name, flags, self.key)
        finally:
            os.close(dfd)

    # ------------------------------------------------------------ names
    def path(self, key: ChunkKey) -> Path:
        parts, name = self._rel(key)
        return self.base.joinpath(*parts, name)

    def rel_path(self, key: ChunkKey) -> bytes:
        """``key``'s object's path below the store's folder (``base_handle``),
        as ``open_read`` opens it where the kernel has ``openat2``."""
        h = key.digest.hex()  # as ``_rel``, in one string (a load names all its keys)
        return f"objects/{key.ns[:8].hex()}/{h[:2]}/{h}{SUFFIX}".encode()

    def _rel(self, key: ChunkKey) -> tuple[tuple[str, ...], str]:
        h = key.digest.hex()
        return ("objects", key.ns[:8].hex(), h[:2]), h + SUFFIX

    def _open_dir(self, parts: Sequence[str], create: bool = False) -> int:
        """A descriptor of ``base/parts...``, each level opened with
        O_NOFOLLOW: a symlink planted in a shared folder must never lead
        kvtier outside the store (O_NOFOLLOW on a whole path only guards its
        last component). Missing levels are created 0700 with ``create``,
        else FileNotFoundError; a symlink or a file where a folder belongs
        raises OSError (ELOOP or ENOTDIR). ``base`` itself is never created
        here: if it vanished, so did the mount it lives on, and kvtier must
        not fill the disk beneath a dead mount point."""
        return self._open_below(os.open(self.base, _DIR_FLAGS), parts, create, own=True)

    @staticmethod
    def _open_below(fd: int, parts: Sequence[str], create: bool = False, own: bool = False) -> int:
        """``_open_dir`` from folder ``fd`` (closed here if ``own``)."""
        start = fd
        try:
            for part in parts:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                if own or fd != start:
                    os.close(fd)
                fd = nxt
        except BaseException:
            if own or fd != start:
                os.close(fd)
            raise
        return fd if own or fd != start else os.dup(fd)

    def base_handle(self) -> "BaseHandle":
        """The store's folder, opened once for a run of reads (a load), not
        once per object: ``open_read(..., base=)``."""
        return BaseHandle(self.base)

    # ------------------------------------------------------------ read
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
                    if exc.errno in _NOT_OURS:
                        raise CorruptObject(f"a symlink or file where a folder belongs ({exc.strerror})") from None
                    raise
                try:
                    return self._open_object(dfd, name, o_direct)
                finally:
                    os.close(dfd)
            try:
                return self._open_object(handle.fd(), "/".join((*parts, name)), o_direct, beneath.open_beneath)
            except OSError as exc:
                if exc.errno in _NOT_OURS:
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
            if o_direct and self.direct_ok and _O_DIRECT:
                try:
                    return open_at(dfd, name, flags | _O_DIRECT), True
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
            if exc.errno in _NOT_OURS:
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

    # ------------------------------------------------------------ write
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
        direct = direct and self.direct_writes and bool(_O_DIRECT)
        try:
            try:
                fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o600, dir_fd=tdir)
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
                _unlink_at(tdir, tmp)
                raise
        except BaseException:
            os.close(tdir)
            raise
        return PendingWrite(self, tdir, fd, tmp, direct)

    def exists(self, key: ChunkKey) -> bool:
        # A plain stat (one round trip on a network mount). It may follow a
        # planted folder link: that only answers "present"; the read refuses.
        try:
            return os.stat(self.path(key), follow_symlinks=False).st_size >= HEADER_BLOCK
        except OSError:
            return False

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
                _unlink_at(src, name)  # nowhere safe to keep it: remove it
                return
            try:
                os.rename(name, dst, src_dir_fd=src, dst_dir_fd=qdir)
            except FileNotFoundError:
                pass
            except OSError:
                _unlink_at(src, name)
            finally:
                os.close(qdir)
        finally:
            os.close(src)

    # ------------------------------------------------------------ housekeeping
    def sweep_tmp(self, max_age_s: float, now: float | None = None) -> int:
        """Remove temp files left by dead writers: this host's files whose
        writer process is gone, and anyone's older than ``max_age_s``."""
        now = time.time() if now is None else now

        def dead_or_old(name: str, mtime: float) -> bool:
            host, _, rest = name.partition(".")
            pid_s = rest.partition(".")[0]
            dead = host == HOST and pid_s.isdigit() and not pid_alive(int(pid_s))
            return dead or now - mtime > max_age_s

        return self._sweep("tmp", dead_or_old)

    def count(self, folder: str) -> int:
        """Entries in ``tmp`` or ``quarantine`` (0 if the folder is missing
        or is not a folder)."""
        try:
            dfd = self._open_dir((folder,))  # a link there is not ours: not counted through
        except OSError:
            return 0
        try:
            with os.scandir(dfd) as it:
                return sum(1 for _ in it)
        finally:
            os.close(dfd)

    def tmp_bytes(self) -> int:
        """Bytes of the temp files now in ``tmp/`` (writes in flight)."""
        try:
            dfd = self._open_dir(("tmp",))
        except OSError:
            return 0
        total = 0
        try:
            with os.scandir(dfd) as it:
                for entry in it:
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
        finally:
            os.close(dfd)
        return total

    def sweep_quarantine(self, max_age_s: float) -> int:
        """Remove quarantined objects older than ``max_age_s``."""
        now = time.time()
        return self._sweep("quarantine", lambda name, mtime: now - mtime > max_age_s)

    def _sweep(self, folder: str, doomed: Callable[[str, float], bool]) -> int:
        # Through a descriptor opened with O_NOFOLLOW: a folder replaced by a
        # link to somewhere else is not swept.
        try:
            dfd = self._open_dir((folder,))
        except OSError:
            return 0
        removed = 0
        try:
            with os.scandir(dfd) as it:
                entries = list(it)
            for entry in entries:
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                if doomed(entry.name, mtime):
                    removed += _unlink_at(dfd, entry.name)
        finally:
            os.close(dfd)
        return removed

    def scan(self) -> Iterator[ObjectEntry]:
        """Every published object: regular files under names kvtier writes.
        Anything else (links, junk, another program's files) is not ours:
        never counted, evicted or collected."""
        for ns_dir in _scandir(self.objects):
            if not _is_hex(ns_dir.name, 16) or not ns_dir.is_dir(follow_symlinks=False):
                continue
            for fan in _scandir(Path(ns_dir.path)):
                if not _is_hex(fan.name, 2) or not fan.is_dir(follow_symlinks=False):
                    continue
                for e in _scandir(Path(fan.path)):
                    name = e.name[: -len(SUFFIX)]
                    if (not e.name.endswith(SUFFIX) or not _is_hex(name, 64) or not name.startswith(fan.name)
                            or not e.is_file(follow_symlinks=False)):
                        continue
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    yield ObjectEntry(Path(e.path), name, ns_dir.name, st.st_size, st.st_mtime)

    def drop_cache(self) -> int:
        """Write back and drop every object from the page cache (cold reads)."""
        n = 0
        for entry in self.scan():
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
        return n


class PendingWrite:
    """One object being written to ``tmp/`` (see ``ObjectDir.begin_write``).
    Owned by the thread that began it; ``publish`` or ``abort`` ends it."""

    def __init__(self, odir: ObjectDir, tdir: int, fd: int, name: str, direct: bool = False):
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
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
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
            _unlink_at(self._tdir, self.name)
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


def _is_hex(name: str, length: int) -> bool:
    return len(name) == length and all(c in "0123456789abcdef" for c in name)


def _scandir(path: Path):
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def _unlink_at(dir_fd: int, name: str) -> int:
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0


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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
