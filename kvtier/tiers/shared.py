"""Shared directory tier: one directory on a mount that many processes and
machines use at once (NFS, Lustre, 3FS, Weka, ... in production).

- Publication by rename from ``tmp/``: readers see nothing or a whole object.
- Check before write: an object another instance already published is not
  written again (spares the array's flash and the network).
- Access index: on a hit, kvtier stamps the object's mtime itself (at most
  once per ``touch_interval_s``), so recency does not depend on atime, which
  shared mounts usually disable.
- Capacity: a garbage collector (``gc``) deletes what the ``eviction``
  policy picks from the objects ranked by their stamps: by default
  (``watermark``) the least recently stamped objects once usage passes
  ``high_watermark`` until it falls under ``low_watermark``. Any instance may run it (``kvtier store gc`` or the
  automatic pass every ``gc_interval_s``): a lease file keeps two collectors
  from working at once, and deleting a content-addressed object is always
  safe (a reader that already opened it keeps its data; a later reader
  misses and recomputes).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, ClassVar

from kvtier.configfields import opt
from kvtier.concurrency.executor import MAINTENANCE
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.collector import CollectedConfig, Collector, GcResult, Trigger, plan
from kvtier.tiers.dir.journal import RemovalJournal
from kvtier.tiers.dir.lease import DirLeases
from kvtier.tiers.dir.fileread import OpenRead
from kvtier.tiers.dir.layout import ObjectEntry
from kvtier.tiers.dir.filetier import FileTier, FileTierConfig
from kvtier.tiers.dir.stamps import LoadStamps
from kvtier.tiers.eviction import make

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedConfig(CollectedConfig, FileTierConfig):
    # Many processes and nodes read the folder: recency is the objects'
    # stamps, which only a policy ranked by recency can use.
    stamped_recency: ClassVar[bool] = True

    name: str = opt("shared", "tier name in metrics and logs")
    touch_interval_s: float = opt(60.0, "minimum seconds between two access stamps of one object", ge=0)
    gc_interval_s: float = opt(60.0, "seconds between automatic collection passes of this instance (0: never)", ge=0)
    tmp_max_age_s: float = opt(3600.0, "temp files older than this are another writer's leftovers", gt=0)
    lease_s: float = opt(600.0, "a collector's lease; a newer collector takes over an older lease", gt=0)

    def validate(self, prefix: str = "") -> None:
        super().validate(prefix)
        self.check_collection(prefix)

    def check_location(self, prefix: str = "") -> None:
        """Raise ConfigError unless the folder exists on this node (a mount
        point that is not mounted is refused, never filled locally)."""
        from kvtier.tiers.dir.folders import check_shared_root

        check_shared_root(self.path, f"{prefix}path")


def plan_collection(entries: list[ObjectEntry], config) -> GcResult:
    """What one collection pass over ``entries`` would delete under
    ``config``'s eviction policy (``collector.plan``, least recently
    stamped first), without a lease and without deleting: ``kvtier store gc
    --dry-run``."""
    t0 = time.monotonic()
    total, victims = plan(make(config.eviction, config), entries, _size, _mtime)
    after = total - sum(e.size for e in victims)
    return GcResult(True, len(entries), total, len(victims), after, seconds=time.monotonic() - t0, victims=tuple(victims))


def _size(e: ObjectEntry) -> int:
    return e.size


def _mtime(e: ObjectEntry) -> float:
    return e.mtime


# How long a collection pass waits for the stamps loads still owe (stamps.py):
# a pool job each, made as soon as a load ends, unless the mount hangs.
_SETTLE_S = 5.0


class SharedTier(FileTier):
    kind = "shared"
    shared_medium = True
    Config = SharedConfig
    defer_stamps = True  # a stamp is a round trip to the mount: made once the load's consumer is done
    shared_folder = True  # the folder must exist (a mount point): an unmounted one is not filled locally

    def __init__(self, config: SharedConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        self._used_estimate = 0  # last scan + own writes since
        self._objects_estimate = 0
        self._trigger = Trigger(make(config.eviction, config), config.gc_interval_s)
        self._leases = DirLeases(self.dir, config.lease_s)
        # What collection passes deleted, for other engines' KV events (journal.py).
        self.journal = RemovalJournal(self.dir)
        self._collector: Collector[ObjectEntry] = Collector(self.name, lambda: make(config.eviction, config),
                                                            self._leases, self.metrics)
        swept = self.dir.sweep_tmp(config.tmp_max_age_s)
        if swept:
            log.info("tier %s: swept %d orphaned temp files", self.name, swept)

    # ------------------------------------------------------------ hooks
    def _touched(self, key: ChunkKey, mtime: float, op: OpenRead | None = None,
                 later: LoadStamps | None = None) -> None:
        self.dir.stamp(key, mtime, self.config.touch_interval_s, op, later)

    def _stamped_since(self) -> float:
        # As the load begins: an object stamped since is not stamped again by it.
        return time.time() - self.config.touch_interval_s

    def _stored(self, key, obj) -> None:
        """Count our write; start a background collection pass when one is due:
        the first write after start (it also measures usage), every
        ``gc_interval_s``, and sooner (at most every 5 s) once this instance's
        view of usage passes the high watermark."""
        with self._lock:
            self._used_estimate += obj.nbytes
            self._objects_estimate += 1
            used = self._used_estimate
        due = self._trigger.due(used)
        self.metrics.used(used)
        if due:
            fut = self.executor.submit(MAINTENANCE, self._auto_gc)
            fut.add_done_callback(_log_failure(self.name))

    @property
    def _gc_pending(self) -> bool:  # (tests watch the trigger)
        return self._trigger.pending

    @property
    def _last_gc(self) -> float | None:
        return self._trigger.last

    def _auto_gc(self) -> None:
        try:
            self.gc()
        finally:
            self._trigger.done()

    # ------------------------------------------------------------ gc
    def gc(self, dry_run: bool = False, progress: Callable[[int], None] | None = None,
           approve: Callable[[GcResult], None] | None = None) -> GcResult:
        """One collection pass (``Collector``; ``approve`` sees its plan
        before it deletes, and raises to stop it). Safe to run from any number
        of instances; a dry run takes no lease, deletes and sweeps nothing.
        The stamps this instance's loads still owe are made first (at most
        a few seconds' wait): recency is judged on them. Not by a pass on
        the tier's only I/O thread (the background collector with
        ``io_threads: 1``): the stamps are jobs queued behind it."""
        alone = self.executor.workers == 1 and self.executor.on_worker()
        self._owed.settle(0.0 if alone else _SETTLE_S)

        def scan() -> list[ObjectEntry]:
            entries = []
            for e in self.dir.scan():
                entries.append(e)
                if progress is not None:
                    progress(1)
            return entries

        deleted: list[bytes] = []  # this pass's, for the removal journal

        def delete(e: ObjectEntry) -> bool:
            if self.dir.unlink_path(e.path) is None:
                return False  # gone meanwhile
            deleted.append(bytes.fromhex(e.key_hex))
            self._removed(deleted[-1:])
            return True

        def finish(r: GcResult) -> GcResult:
            tmp_swept = q_swept = 0
            if not dry_run:
                self.journal.append(deleted)
                tmp_swept = self.dir.sweep_tmp(self.config.tmp_max_age_s)
                q_swept = self._sweep_quarantine()
            with self._lock:
                self._used_estimate = r.bytes_after
                self._objects_estimate = r.objects - r.deleted
            self.metrics.used(r.bytes_after)
            return replace(r, tmp_swept=tmp_swept, quarantine_swept=q_swept, victims=())

        return self._collector.collect(scan, _size, _mtime, delete, dry_run, finish, approve)

    def _take_lease(self, lease: Path) -> str | None:
        """Take the collector lease at ``lease`` (``DirLeases.take_at``): its
        token, or None while another live collector holds it."""
        return self._leases.take_at(lease)

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
                self._removed([k.digest])
        with self._lock:
            self._used_estimate = max(0, self._used_estimate - freed)
            self._objects_estimate = max(0, self._objects_estimate - n)
            used = self._used_estimate
        self.metrics.used(used)
        return n

    def _forget(self, key: ChunkKey) -> None:
        # Missing where a read looked (another node's collector, an
        # operator), or quarantined: this instance's view of it ends.
        self._removed([key.digest])

    def clear(self) -> int:
        """Removes nothing: a store that other processes and nodes share is
        emptied by its collector (``gc``), never by one of its clients."""
        return 0

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, self._objects_estimate, self._used_estimate, self.capacity)


def _log_failure(name: str):
    def cb(fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error("tier %s: background collection failed: %s", name, fut.exception())

    return cb
