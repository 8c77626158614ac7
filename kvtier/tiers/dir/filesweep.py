"""Housekeeping of an object directory: temp files left by dead writers
and old quarantined objects swept, folders counted, every published object
listed (``scan``) and dropped from the page cache."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator

from kvtier.tiers.dir.layout import HOST, SUFFIX, Layout, ObjectEntry, is_hex, entries_of, remove_at, pid_alive


class FileSweeps(Layout):
    """The housekeeping of ``ObjectDir``."""

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
                    removed += remove_at(dfd, entry.name)
        finally:
            os.close(dfd)
        return removed

    def scan(self) -> Iterator[ObjectEntry]:
        """Every published object: regular files under names kvtier writes.
        Anything else (links, junk, another program's files) is not ours:
        never counted, evicted or collected."""
        for ns_dir in entries_of(self.objects):
            if not is_hex(ns_dir.name, 16) or not ns_dir.is_dir(follow_symlinks=False):
                continue
            for fan in entries_of(Path(ns_dir.path)):
                if not is_hex(fan.name, 2) or not fan.is_dir(follow_symlinks=False):
                    continue
                for e in entries_of(Path(fan.path)):
                    name = e.name[: -len(SUFFIX)]
                    if (not e.name.endswith(SUFFIX) or not is_hex(name, 64) or not name.startswith(fan.name)
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
