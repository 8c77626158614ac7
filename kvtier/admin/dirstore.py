"""A tier's directory opened for administration (``kvtier store``).

``AdminStore(path)`` opens an existing store without creating or writing
anything and tells its kind from the files the tiers keep beside their
objects:

    disk    kvtier-v1/disk.lock     one owner: the process whose disk tier it is
    shm     kvtier-v1/node.ledger   the node memory tier: its processes, under its node lock
    shared  neither                 any process on any node

Looking (``ls``, ``stat``, ``verify`` without ``--quarantine``) works on every
kind at any time. What changes the directory, or reads it all, is done the way
the owning tier would do it, and only where the tier lets it:

- **disk**: ``claim`` takes the tier's own owner lock without waiting. While an
  engine holds it, ``verify`` and ``gc`` refuse (``ConfigError``: exit status
  2, naming the fix): the tier counts every file it holds, and a file deleted
  or moved behind it would still be counted against its capacity. While they
  run, an engine that starts on the folder refuses in turn. ``gc`` on a
  stopped disk tier is the tier's own start-up eviction (least recently used
  first, by its access log), run by opening the tier; its dry run reads the
  same log.
- **shm**: only looked at. The node memory tier admits, evicts and removes bad
  objects itself, under its node lock; a change behind its ledger would skew
  it for every process of the node.
- **shared**: anything, from any node, while engines use it: a collection pass
  takes the tier's lease (``SharedTier.gc``), and deleting or moving a
  content-addressed object is safe under readers.

A ``gc`` pass deletes no more than a routine pass would (``confirm``) unless
its caller confirms it (``--yes``): a capacity given far below the tier's
real one (a unit forgotten) would otherwise empty a tier every node uses.

Verification is the tiers' own: each object's header is read as ``read``
opens objects (folder by folder, O_NOFOLLOW), then the object is read and
verified with the key the header names (``ObjectDir.read``), and a bad one is
quarantined as the tiers do it (``ObjectDir.quarantine_path``:
``quarantine/KEY.TIME.kvc``).
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvtier.auth import SEAL_PROBLEMS, Keyring
from kvtier.codec import seal_problem
from kvtier.errors import ConfigError, CorruptObject
from kvtier.keys import ChunkKey
from kvtier.progress import Progress, silent
from kvtier.tiers.disk import OWNER_LOCK
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.layout import ObjectEntry
from kvtier.tiers.eviction import make
from kvtier.tiers.shm import NODE_LEDGER

# A file under kvtier-v1/ and the kind of tier that keeps it; none: shared.
KIND_MARKS = (("disk", OWNER_LOCK), ("shm", NODE_LEDGER))


@dataclass
class VerifyReport:
    ok: int = 0
    bad: list[tuple[Path, str]] = field(default_factory=list)


class AdminStore:
    """An existing store at ``path``, opened to administer (see the module's
    docstring). ``close`` (or ``with``) releases what ``claim`` took."""

    def __init__(self, path: str | os.PathLike, key: str = "--dir"):
        self.key = key
        self.dir = ObjectDir(path, key, create=False)  # a missing store is an error; nothing is created
        self.kind = next((kind for kind, mark in KIND_MARKS if (self.dir.base / mark).exists()), "shared")
        self._owner_fd = -1

    def __enter__(self) -> "AdminStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._owner_fd >= 0:
            os.close(self._owner_fd)  # releases the owner lock
            self._owner_fd = -1

    # ------------------------------------------------------------ ownership
    def claim(self, command: str) -> None:
        """Take what ``command`` needs from the directory's owner, or raise
        ConfigError naming the fix. A disk tier's owner lock is held until
        ``close``."""
        if self.kind == "shm":
            raise ConfigError(
                self.key, f"{self.dir.root} is a node memory tier (shm): it admits, evicts and removes bad objects "
                "itself, under its node lock, and `kvtier store {command}` would change files behind its ledger",
                "leave it to the tier (`kvtier store stat`, `ls` and `verify` without --quarantine only look); "
                "to empty it, stop every engine of the node and delete the folder")
        if self.kind != "disk" or self._owner_fd >= 0:
            return
        lock = self.dir.base / OWNER_LOCK
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(self.key, f"cannot open the disk tier's owner lock {lock} ({exc.strerror or exc})",
                              "check the folder's permissions; kvtier keeps a regular file there") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                self.key, f"{self.dir.root} is the disk tier of a running kvtier engine (it holds {lock}), and "
                f"`kvtier store {command}` needs it to itself: a disk tier has one owner, which counts every file "
                "it holds",
                "stop that engine first, then run this again; while it runs, the tier itself verifies every object "
                "it reads (quarantining bad ones) and keeps under its capacity, and `kvtier store stat` and `ls` "
                "show it without touching it") from None
        self._owner_fd = fd

    # ------------------------------------------------------------ verify
    def verify(self, quarantine: bool, progress: Progress = silent, keyring: Keyring | None = None) -> VerifyReport:
        """Read and check every object (``verify_objects``); with
        ``quarantine``, move bad ones aside the tiers' way, else write
        nothing. A disk tier's folder only with its owner lock."""
        if quarantine or self.kind == "disk":
            self.claim("verify")
        entries = list(self.dir.scan())
        return verify_objects(self.dir, entries, quarantine, progress("verify", len(entries)), keyring)

    # ------------------------------------------------------------ gc
    def gc(self, cfg, dry_run: bool, yes: bool = False):
        """One collection pass under ``cfg`` (a ``SharedConfig`` of this
        directory: capacity and watermarks) (``GcResult``). A pass that
        would delete more than a routine one (``confirm``) raises
        ConfigError naming what would go, unless ``yes``; ``dry_run`` only
        plans (the result's ``victims``: what would go, least recent first).

        shared: the tier's own pass under its lease (``SharedTier.gc``), or
        with ``dry_run`` its plan alone (``plan_collection``: no lease, no
        sweep, no deletion). disk: the tier's start-up eviction, least
        recently used first by its access log, down to the low watermark of
        the capacity once usage passes the high one."""
        from kvtier.tiers.shared import SharedTier, plan_collection

        self.claim("gc")
        if self.kind == "disk":
            plan = self._disk_plan(cfg)
            if dry_run:
                return plan
            confirm(plan, cfg, yes, self.dir.root)
            return self._disk_gc(cfg)
        if dry_run:
            return plan_collection(list(self.dir.scan()), cfg)
        tier = SharedTier(cfg)
        try:
            return tier.gc(approve=lambda plan: confirm(plan, cfg, yes, self.dir.root))
        finally:
            tier.close()

    def _disk_plan(self, cfg):
        """What the disk tier's eviction under ``cfg`` would delete, read
        from its folder and access log without changing either: the
        objects in the log's order, least recently used first, through
        ``cfg``'s eviction policy (watermarks)."""
        from kvtier.tiers.collector import GcResult
        from kvtier.tiers.disk import by_recency

        t0 = time.monotonic()
        order, _ = by_recency(self.dir)
        policy = make(cfg.eviction, cfg)
        for _, e, _ in order:
            policy.insert(e, e.size)
        before = policy.used
        victims = policy.victims(policy.to_free(before))
        used = before - sum(e.size for e in victims)
        return GcResult(True, len(order), before, len(victims), used, seconds=time.monotonic() - t0,
                        victims=tuple(victims))

    def _disk_gc(self, cfg):
        from kvtier.tiers.disk import DiskConfig, DiskTier
        from kvtier.tiers.collector import GcResult

        t0 = time.monotonic()
        entries = list(self.dir.scan())
        before = sum(e.size for e in entries)
        target = _disk_target(cfg, before)
        tmp_before = self.dir.count("tmp")
        # The tier takes its owner lock itself: ours goes first. An engine
        # that starts in between makes the tier refuse (ConfigError) instead.
        self.close()
        tier = DiskTier(DiskConfig(path=str(self.dir.root), capacity=max(1, target)))
        try:
            after = tier.stats()
        finally:
            tier.close()
        return GcResult(True, len(entries), before, len(entries) - after.objects, after.used_bytes,
                        max(0, tmp_before - self.dir.count("tmp")), 0, time.monotonic() - t0)


def _disk_target(cfg, used: int) -> int:
    """Bytes a pass under ``cfg``'s eviction policy (watermarks, as the
    shared tier's) leaves of ``used``: the capacity the disk tier is opened
    with, so that its own start-up eviction (LRU, just enough) goes as far."""
    free = make(cfg.eviction, cfg).to_free(used)
    return used - free if free else cfg.capacity


# A pass that would delete more than this share of a tier's objects or bytes
# asks for --yes, unless the watermarks themselves ask for more: a routine
# pass, started as usage passes the high watermark, frees about 1 - low/high
# of what the tier holds (0.105 at the defaults). Far more is the mark of a
# capacity given far below what the tier holds: a unit forgotten, a typo.
CONFIRM_SHARE = 0.25


def confirm_limit(cfg) -> float:
    """The share of a tier's objects or bytes a pass under ``cfg`` may
    delete without --yes."""
    return max(CONFIRM_SHARE, 1 - cfg.low_watermark / cfg.high_watermark)


def confirm(plan, cfg, yes: bool, root) -> None:
    """Raise ConfigError (exit status 2) naming what ``plan`` (a
    ``GcResult`` before deletion) would delete, when it is more than a
    routine pass would (``confirm_limit``) and ``yes`` was not given."""
    if yes or not plan.deleted:
        return
    freed = plan.bytes_before - plan.bytes_after
    share = max(plan.deleted / max(1, plan.objects), freed / max(1, plan.bytes_before))
    limit = confirm_limit(cfg)
    if share <= limit:
        return
    raise ConfigError(
        "--capacity", f"this pass would delete {plan.deleted} of the {plan.objects} objects in {root} "
        f"({_size(freed)} of {_size(plan.bytes_before)}, {share:.0%}), the least recently used, to bring usage "
        f"under {cfg.low_watermark:g} x --capacity {_size(cfg.capacity)}; a routine pass deletes at most "
        f"{limit:.0%}, so --capacity may be far below the tier's real capacity",
        "give the tier's capacity with its unit (e.g. --capacity 10TiB); see what would go with --dry-run; "
        "to delete it all the same, run again with --yes")


def _size(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def verify_objects(odir: ObjectDir, entries: Sequence[ObjectEntry], quarantine: bool,
                   tick: Callable[[int], None] = lambda n: None, keyring: Keyring | None = None) -> VerifyReport:
    """Check ``entries`` (from ``odir.scan()``) with the tiers' own reads;
    with ``quarantine``, move bad ones aside as the tiers do. The caller owns
    the directory (``AdminStore.verify``, or the process whose tier it is).

    Without the token ids nobody can recompute a key, so what is checked is
    what each object itself promises: its header parses, its key is the one in
    its file name, its namespace is the one of its folder, and the tiers' read
    accepts it for that key (payload complete, checksum); with ``keyring``,
    that its seal proves a holder of one of its keys wrote it, as an engine
    with those keys demands before it serves an object."""
    report = VerifyReport()
    for e in entries:
        try:
            h = odir.header_at(e.path)
            if h.key.hex() != e.key_hex or h.ns[:8].hex() != e.ns_hex:
                raise CorruptObject("header key or namespace does not match the object's path")
            obj, _ = odir.read(ChunkKey(h.key, h.check, h.ns, h.num_tokens), o_direct=False, cold=True)
            try:
                problem = None if keyring is None else seal_problem(obj, keyring)
            finally:
                obj.release()
            if problem is not None:
                raise CorruptObject(f"not served: {problem} ({SEAL_PROBLEMS[problem]})")
            report.ok += 1
        except FileNotFoundError:
            pass  # collected meanwhile
        except (CorruptObject, OSError) as exc:
            report.bad.append((e.path, str(exc)))
            if quarantine:
                odir.quarantine_path(e.path)
        tick(1)
    return report
