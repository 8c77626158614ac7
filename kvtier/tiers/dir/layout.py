"""Names and folders of an object directory: the layout every directory
tier keeps its objects in, and the one way kvtier opens a folder in it.

Layout under the configured directory::

    kvtier-v1/objects/<ns:16 hex>/<key[0]:2 hex>/<key:64 hex>.kvc
    kvtier-v1/tmp/<host>.<pid>.<random>.tmp        writes in progress
    kvtier-v1/quarantine/<key>.<unix time>.kvc     objects that failed checks

Names hold only hex digests: no token, model or tenant text ever appears in a
path. Every folder is opened one level at a time with O_NOFOLLOW
(``Layout._open_dir``): the reads (``fileread``), the writes (``filewrite``)
and the housekeeping (``filesweep``) all go through it, so that a symlink
planted in a shared folder never leads kvtier outside the store. Folders are
made 0700 and checked as ``folders`` says (a node's private tiers: this
user's alone).
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.tiers.dir import folders

LAYOUT_DIR = "kvtier-v1"
SUFFIX = ".kvc"
O_DIRECT = getattr(os, "O_DIRECT", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
NOT_OURS = (errno.ELOOP, errno.ENOTDIR)  # a symlink or a file where a folder belongs
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
                self._fd = os.open(self.path, DIR_FLAGS)
            return self._fd

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class Layout:
    """An object directory's paths and folder opening: the base of
    ``ObjectDir`` (``files``), which adds the reads, writes and
    housekeeping. Thread-safe; no state beyond paths and the O_DIRECT
    fallback flags."""

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
        dfd = os.open(self.base, DIR_FLAGS)
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
        return self._open_below(os.open(self.base, DIR_FLAGS), parts, create, own=True)

    @staticmethod
    def _open_below(fd: int, parts: Sequence[str], create: bool = False, own: bool = False) -> int:
        """``_open_dir`` from folder ``fd`` (closed here if ``own``)."""
        start = fd
        try:
            for part in parts:
                try:
                    nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o700, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
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


def is_hex(name: str, length: int) -> bool:
    return len(name) == length and all(c in "0123456789abcdef" for c in name)


def entries_of(path: Path):
    """The entries of ``path``; none if it is missing or is not a folder."""
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def remove_at(dir_fd: int, name: str) -> int:
    """Remove ``name`` in folder ``dir_fd``: 1 if it was removed, else 0."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
