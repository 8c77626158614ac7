"""The shared directory tier's removal journal: which objects collection
passes deleted, for the engines that told routers those objects were there.

Any node's collector (the automatic pass of an engine, or ``kvtier store
gc``) deletes objects other engines wrote. Those engines published KV
events for them (``BlockStored``, locality ``REMOTE``), and their own tiers
never see the deletion. So each collection pass that deleted anything
writes one journal file, the digests it deleted (32 bytes each), and every
engine with KV events on reads the files it has not read yet, every
``interval`` seconds, and publishes ``BlockRemoved`` for the chunks it had
published.

Layout and records: ``removals`` (one file per pass in
``kvtier-v1/removed/``), written in full under a temporary name in the
folder and renamed in (readers never see half a file). Files older than
``keep_s`` are removed by the next pass that writes one. The folder is
opened like every folder of the store (``folders.subfolder``: no link
followed).

Cost, for a reader: one listing of the folder per interval, and each new
file read once (32 bytes per deleted object: a pass that deletes 10,000
objects writes 320 KB). For a writer: one file per pass.

Untrusted input: anyone who can write the shared folder can write a
journal file. The worst a forged file does is make routers believe some
blocks are gone (a routing miss, never wrong KV): a reader takes only
whole 32-byte records, from regular files no larger than ``MAX_ENTRY``.

Threads: ``append`` on the collector's thread; ``read_new`` on one
caller's thread at a time (it keeps the names it has read).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Iterable

from kvtier.tiers.dir import folders
from kvtier.tiers.dir.layout import DIR_FLAGS, HOST, Layout
from kvtier.tiers.removals import FOLDER, KEEP_S, MAX_ENTRY, body, expired, new_name, records, time_of

log = logging.getLogger(__name__)


class RemovalJournal:
    def __init__(self, layout: Layout, keep_s: float = KEEP_S):
        self.layout = layout
        self.keep_s = keep_s
        self.path = layout.base / FOLDER
        self._read: set[str] = set()  # names read already (those still in the folder)

    def _folder(self) -> int:
        base = os.open(self.layout.base, DIR_FLAGS)
        try:
            return folders.subfolder(base, self.layout.base, FOLDER, self.layout.key, self.layout.shared)
        finally:
            os.close(base)

    def append(self, digests: Iterable[bytes]) -> int:
        """Record one pass's deletions; returns the bytes written (0: none,
        or the journal could not be written: logged, never raised)."""
        data = body(digests)
        if not data:
            return 0
        name = new_name(HOST)
        tmp = f".{name}.tmp"
        try:
            fd = self._folder()
            try:
                out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
                with os.fdopen(out, "wb") as f:
                    f.write(data)
                os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
                self._sweep(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("removal journal %s: not written (%s): routers learn of these deletions late",
                        self.path, exc.strerror or exc)
            return 0
        return len(data)

    def _sweep(self, fd: int) -> None:
        for name in os.listdir(fd):
            if expired(name, self.keep_s):
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass  # another pass swept it

    def read_new(self) -> list[bytes]:
        """The digests in journal files not read before by this object
        (none while the folder is missing or unreadable)."""
        try:
            base = os.open(self.layout.base, DIR_FLAGS)
        except OSError:
            return []
        try:
            try:
                fd = os.open(FOLDER, DIR_FLAGS, dir_fd=base)
            except OSError:
                return []  # no pass deleted anything yet
        finally:
            os.close(base)
        out: list[bytes] = []
        try:
            names = [n for n in os.listdir(fd) if time_of(n) is not None]
            for name in sorted(set(names) - self._read):
                out += _records(fd, name)
            self._read = set(names)
        except OSError as exc:
            log.warning("removal journal %s: not read (%s)", self.path, exc.strerror or exc)
        finally:
            os.close(fd)
        return out


def _records(fd: int, name: str) -> list[bytes]:
    """The whole records of one journal file; [] for anything that is not
    a regular file of a sane size."""
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            log.warning("removal journal: %s not read (%s)", name, exc.strerror or exc)
        return []
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY:
            return []
        data = b""
        while len(data) < st.st_size:
            chunk = os.read(f, st.st_size - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(f)
    return records(data)

