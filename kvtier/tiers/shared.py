"""Shared directory tier: one directory on a mount that many processes and
machines use at once (NFS, Lustre, 3FS, Weka, ... in production).

- Publication by rename from ``tmp/``: readers see nothing or a whole object.
- Check before write: an object another instance already published is not
  written again (spares the array's flash and the network).
- Access index: on a hit, kvtier stamps the object's mtime itself (at most
  once per ``touch_interval_s``), so recency does not depend on atime, which
  shared mounts usually disable.
- Capacity: a watermark garbage collector (``gc``) deletes the least recently
  stamped objects once usage passes ``high_watermark`` until it falls under
  ``low_watermark``. Any instance may run it (``kvtier store gc`` or the
  automatic pass every ``gc_interval_s``): a lease file keeps two collectors
  from working at once, and deleting a content-addressed object is always
  safe (a reader that already opened it keeps its data; a later reader
  misses and recomputes).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtier.config import check_watermarks, opt
from kvtier.engine.executor import MAINTENANCE
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.files import HOST, pid_alive
from kvtier.tiers.filetier import FileTier, FileTierConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedConfig(FileTierConfig):
    name: str = opt("shared", "tier name in metrics and logs")
    high_watermark: float = opt(0.95, "usage fraction of capacity that starts garbage collection")
    low_watermark: float = opt(0.85, "usage fraction garbage collection brings usage down to")
    touch_interval_s: float = opt(60.0, "minimum seconds between two access stamps of one object", ge=0)
    gc_interval_s: float = opt(60.0, "seconds between automatic collection passes of this instance (0: never)", ge=0)
    tmp_max_age_s: float = opt(3600.0, "temp files older than this are another writer's leftovers", gt=0)
    lease_s: float = opt(600.0, "a collector's lease; a newer collector takes over an older lease", gt=0)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        check_watermarks(prefix, self.low_watermark, self.high_watermark)


@dataclass(frozen=True)
class GcResult:
    ran: bool
    objects: int
    bytes_before: int
    deleted: int
    bytes_after: int
    tmp_swept: int
    quarantine_swept: int
    seconds: float
    victims: tuple = ()  # plan_collection only: the objects a pass would delete, oldest first


def plan_collection(entries, config) -> GcResult:
    """What one collection pass over ``entries`` deletes under ``config``'s
    watermarks: once usage passes ``high_watermark`` of capacity, the least
    recently stamped objects until usage is at most ``low_watermark``. The
    policy itself; ``SharedTier.gc`` carries it out, ``kvtier store gc
    --dry-run`` only reports it."""
    t0 = time.monotonic()
    total = sum(e.size for e in entries)
    after, victims = total, []
    if total > config.high_watermark * config.capacity:
        target = config.low_watermark * config.capacity
        for e in sorted(entries, key=lambda e: e.mtime):
            if after <= target:
                break
            victims.append(e)
            after -= e.size
    return GcResult(True, len(entries), total, len(victims), after, 0, 0, time.monotonic() - t0, tuple(victims))


class SharedTier(FileTier):
    kind = "shared"
    Config = SharedConfig

    def __init__(self, config: SharedConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        self._used_estimate = 0  # last scan + own writes since
        self._objects_estimate = 0
        self._last_gc: float | None = None  # no pass yet: the first write starts one
        self._gc_pending = False
        swept = self.dir.sweep_tmp(config.tmp_max_age_s)
        if swept:
            log.info("tier %s: swept %d orphaned temp files", self.name, swept)

    # ------------------------------------------------------------ hooks
    def _touched(self, key: ChunkKey, mtime: float) -> None:
        self.dir.stamp(key, mtime, self.config.touch_interval_s)

    def _stored(self, key, obj) -> None:
        """Count our write; start a background collection pass when one is due:
        the first write after start (it also measures usage), every
        ``gc_interval_s``, and sooner (at most every 5 s) once this instance's
        view of usage passes the high watermark."""
        with self._lock:
            self._used_estimate += obj.nbytes
            self._objects_estimate += 1
            interval = self.config.gc_interval_s
            since = time.monotonic() - self._last_gc if self._last_gc is not None else float("inf")
            over = self._used_estimate > self.config.high_watermark * self.capacity
            due = (
                interval > 0
                and not self._gc_pending
                and (since >= interval or (over and since >= min(interval, 5.0)))
            )
            if due:
                self._gc_pending = True
        self.metrics.used(self._used_estimate)
        if due:
            fut = self.executor.submit(MAINTENANCE, self._auto_gc)
            fut.add_done_callback(_log_failure(self.name))

    def _auto_gc(self) -> None:
        try:
            self.gc()
        finally:
            with self._lock:
                self._gc_pending = False
                self._last_gc = time.monotonic()

    # ------------------------------------------------------------ gc
    def gc(self, dry_run: bool = False, progress: Callable[[int], None] | None = None) -> GcResult:
        """One collection pass. Safe to run from any number of instances."""
        t0 = time.monotonic()
        lease = self.dir.base / "gc.lease"
        token = None if dry_run else self._take_lease(lease)
        if not dry_run and token is None:
            return GcResult(False, 0, 0, 0, 0, 0, 0, time.monotonic() - t0)
        try:
            entries = []
            for e in self.dir.scan():
                entries.append(e)
                if progress is not None:
                    progress(1)
            plan = plan_collection(entries, self.config)
            total, deleted, after = plan.bytes_before, 0, plan.bytes_before
            for e in plan.victims:
                if not dry_run and self.dir.unlink_path(e.path) is None:
                    continue  # gone meanwhile (or not ours to remove)
                after -= e.size
                deleted += 1
            tmp_swept = q_swept = 0
            if not dry_run:
                tmp_swept = self.dir.sweep_tmp(self.config.tmp_max_age_s)
                q_swept = self._sweep_quarantine()
                if deleted:
                    self.metrics.evicted(deleted)
            with self._lock:
                self._used_estimate = after
                self._objects_estimate = len(entries) - deleted
            self.metrics.used(after)
            return GcResult(True, len(entries), total, deleted, after, tmp_swept, q_swept, time.monotonic() - t0)
        finally:
            if not dry_run:
                _release_lease(lease, token)

    def _take_lease(self, lease: Path) -> str | None:
        """Take the collector lease; returns its token, or None if another live
        collector holds it.

        The lease is written in full under a temporary name and published with
        ``link`` (atomic, fails if a lease exists), so nobody ever reads a
        half-written lease. A stale lease is taken over by renaming it to a
        unique name first: of several collectors racing for it, one rename
        wins. Two collectors running at once is still safe (deletes are
        idempotent); the lease only spares redundant work.
        """
        token = secrets.token_hex(8)
        body = json.dumps({"host": HOST, "pid": os.getpid(), "time": time.time(), "token": token}).encode()
        tmp = self.dir.tmp / f"{HOST}.{os.getpid()}.{token}.lease"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        try:
            for _ in range(2):
                try:
                    os.link(tmp, lease)
                    return token
                except FileExistsError:
                    stale = self._lease_stale(lease)
                    if stale is None:
                        return None
                    grave = lease.with_name(f"gc.lease.{token}.stale")
                    try:
                        os.rename(lease, grave)
                    except FileNotFoundError:
                        continue  # released or taken meanwhile: try again
                    if _lease_token(grave) != stale:
                        # We moved a fresh lease someone took meanwhile: put it back.
                        try:
                            os.link(grave, lease)
                        except FileExistsError:
                            pass
                        _release_lease(grave)
                        return None
                    _release_lease(grave)
            return None
        finally:
            _release_lease(tmp)

    def _lease_stale(self, lease: Path) -> str | None:
        """The token of an abandoned lease, or None if its holder is alive."""
        try:
            info = json.loads(lease.read_bytes())
            age = time.time() - float(info["time"])
            same_host_dead = info.get("host") == HOST and not pid_alive(int(info["pid"]))
            if same_host_dead or age > self.config.lease_s:
                return str(info.get("token", ""))
            return None
        except FileNotFoundError:
            return ""
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable (kvtier publishes leases whole, but a foreign or older
            # writer may not): abandoned only once it is older than a lease.
            try:
                return "" if time.time() - lease.stat().st_mtime > self.config.lease_s else None
            except OSError:
                return ""

    def _sweep_quarantine(self, max_age_s: float = 86400.0) -> int:
        return self.dir.sweep_quarantine(max_age_s)

    # ------------------------------------------------------------ contract
    def _delete_now(self, keys) -> int:
        # This instance's own deletions are part of its view of usage.
        n = freed = 0
        for k in keys:
            size = self.dir.unlink(k)
            if size:
                n += 1
                freed += size
        with self._lock:
            self._used_estimate = max(0, self._used_estimate - freed)
            self._objects_estimate = max(0, self._objects_estimate - n)
            used = self._used_estimate
        self.metrics.used(used)
        return n

    def clear(self) -> int:
        """Removes nothing: a store that other processes and nodes share is
        emptied by its collector (``gc``), never by one of its clients."""
        return 0

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, self._objects_estimate, self._used_estimate, self.capacity)


def _release_lease(lease: Path, token: str | None = None) -> None:
    """Remove a lease file; with ``token``, only if it is still ours."""
    if token is not None and _lease_token(lease) != token:
        return
    try:
        os.unlink(lease)
    except FileNotFoundError:
        pass


def _lease_token(lease: Path) -> str:
    try:
        return str(json.loads(lease.read_bytes()).get("token", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _log_failure(name: str):
    def cb(fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("tier %s: background collection failed: %s", name, fut.exception())

    return cb
