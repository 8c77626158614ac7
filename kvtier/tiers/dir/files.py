"""The object directory: the on-disk layout the disk, node-memory and shared
tiers keep their objects in. Tiers read and write only through ``ObjectDir``.

One class, its jobs in one module each: ``layout`` (names, folders opened
level by level with O_NOFOLLOW, the store's folder held open by a load),
``fileread`` (verified reads), ``filewrite`` (atomic publication, removal,
recency stamps, quarantine), ``filesweep`` (temp-file and quarantine sweeps,
``scan``). Files are opened with O_NOFOLLOW and created 0600 in 0700
directories; objects are published by ``rename`` from ``tmp/`` (same file
system), so a reader sees either no file or a complete one.
"""

from __future__ import annotations

from kvtier.tiers.dir.fileread import FileReads
from kvtier.tiers.dir.filesweep import FileSweeps
from kvtier.tiers.dir.filewrite import FileWrites


class ObjectDir(FileReads, FileWrites, FileSweeps):
    """The directory layout and its file operations. Thread-safe; no state
    beyond paths and the O_DIRECT fallback flags."""
