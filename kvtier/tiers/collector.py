"""The collector of the tiers many instances share (a directory on a shared
mount, S3): one trigger, one pass, one result type, over a lease protocol
each tier implements for its storage, and the tier's eviction policy
(``eviction``; ``watermark`` by default: once usage passes
``high_watermark`` of capacity, delete the least recently used objects
until usage is at most ``low_watermark``).

A pass lists the objects and ranks them by their recency stamps into a
fresh policy (``eviction.rank``): no process sees the others' reads, only
the stamps they leave. An instance starts a pass on its first write, then
once ``interval_s`` has passed since its last pass, sooner (at most every
5 s) while its view of usage is over what the policy allows (``due``). The
capacity planner (``plan/models.py``) runs the same policy and ``due``.

A pass (``Collector.collect``) takes the tier's lease (``Leases``: at most
one pass per store at a time; deletes are idempotent, so two passes at once
only duplicate work), lists the objects, deletes the victims while the lease
is valid, lets the tier finish inside the lease (sweeps, usage figures) and
releases it.

Threads: ``Trigger`` is thread-safe (callers of ``store`` on any thread);
a pass runs on whichever thread calls it (a tier's MAINTENANCE job, or a
caller of ``gc``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Generic, Protocol, TypeVar

from kvtier.configfields import check_watermarks, opt
from kvtier.tiers.eviction import EvictionPolicy, check, rank

log = logging.getLogger(__name__)

E = TypeVar("E")


@dataclass(frozen=True)
class GcResult:
    ran: bool
    objects: int = 0
    bytes_before: int = 0
    deleted: int = 0
    bytes_after: int = 0
    tmp_swept: int = 0
    quarantine_swept: int = 0
    seconds: float = 0.0
    victims: tuple = ()  # a dry run's plan: the objects a pass would delete, least recent first
    reason: str = ""  # why it did not run


@dataclass(frozen=True)
class CollectedConfig:
    """The keys of a tier this collector keeps within capacity (shared
    directory, S3), mixed into its config: put it before a base config so
    that its keys follow that base's."""

    eviction: str = opt("watermark", "eviction policy of the collector: watermark or lru")
    high_watermark: float = opt(0.95, "usage fraction of capacity that starts collection")
    low_watermark: float = opt(0.85, "usage fraction collection brings usage down to")

    def check_collection(self, prefix: str = "") -> None:
        """Raise ConfigError unless 0 < low < high <= 1 and the policy is one
        the collector can run for this tier."""
        check_watermarks(prefix, self.low_watermark, self.high_watermark)
        check(self.eviction, self, f"{prefix}eviction")


def due(policy: EvictionPolicy, interval_s: float, used: int, since_last: float) -> bool:
    """Whether an instance whose last pass was ``since_last`` seconds ago
    (inf: none yet) and whose view of usage is ``used`` starts one, passes
    coming every ``interval_s`` (0: never on its own)."""
    return interval_s > 0 and (since_last >= interval_s or (policy.over(used) and since_last >= min(interval_s, 5.0)))


def plan(policy: EvictionPolicy, entries: list[E], size: Callable[[E], int],
         recency: Callable[[E], float]) -> tuple[int, list[E]]:
    """(total bytes, the objects a pass deletes, first to go first): the
    listed ``entries`` ranked by ``recency`` into ``policy`` (empty)."""
    rank(policy, entries, size, recency)
    return policy.used, policy.victims(policy.to_free(policy.used))


class Trigger:
    """When an instance starts a background pass: ``due(used)`` on each of its
    writes (True at most once until ``done``), ``done()`` when the pass ended,
    ``cancel()`` when it could not be started."""

    def __init__(self, policy: EvictionPolicy, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.policy = policy  # asked only whether usage is over (it holds no keys)
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # no pass yet: the first write starts one
        self._pending = False

    @property
    def pending(self) -> bool:
        """A pass was started and has not ended."""
        with self._lock:
            return self._pending

    @property
    def last(self) -> float | None:
        """When the last pass ended (the clock's time; None: none yet)."""
        with self._lock:
            return self._last

    def due(self, used: int) -> bool:
        with self._lock:
            since = self._clock() - self._last if self._last is not None else float("inf")
            if self._pending or not due(self.policy, self.interval_s, used, since):
                return False
            self._pending = True
            return True

    def done(self) -> None:
        with self._lock:
            self._pending = False
            self._last = self._clock()

    def cancel(self) -> None:
        with self._lock:
            self._pending = False


class Lease(Protocol):
    def valid(self) -> bool:
        """Whether the holder may still delete."""
        ...


class Leases(Protocol):
    """A tier's collector lease: ``take`` returns a lease, or None while
    another collector holds a live one (raises for backend trouble);
    ``release`` gives it up (only if it is still ours)."""

    def take(self) -> Lease | None: ...

    def release(self, lease: Lease) -> None: ...


class Collector(Generic[E]):
    """One collection pass over a tier's objects.

    The tier gives ``policy`` (a new, empty eviction policy for each pass),
    ``list_entries`` (every object: raises ``trouble`` when it
    cannot list), ``size`` and ``recency`` of an entry, ``delete`` (True if
    it removed the object, False if it was gone; raises ``trouble`` to stop
    the pass) and ``trouble`` (the exceptions that mean backend trouble:
    logged and counted as a pass that did not run or stopped early; others
    propagate).
    """

    def __init__(self, name: str, policy: Callable[[], EvictionPolicy], leases: Leases, metrics,
                 trouble: tuple[type[BaseException], ...] = ()):
        self.name = name
        self.policy = policy
        self.leases = leases
        self.metrics = metrics
        self.trouble = trouble

    def collect(
        self,
        list_entries: Callable[[], list[E]],
        size: Callable[[E], int],
        recency: Callable[[E], float],
        delete: Callable[[E], bool],
        dry_run: bool = False,
        finish: Callable[[GcResult], GcResult] = lambda r: r,
        approve: Callable[[GcResult], None] | None = None,
    ) -> GcResult:
        """One pass; a dry run takes no lease and deletes nothing (its result
        carries the victims). ``finish`` runs inside the lease with the
        pass's result and returns the final one (the tier's own sweeps and
        usage figures). ``approve`` sees the plan (victims included) before
        anything is deleted and raises to stop the pass (``kvtier store gc``
        asks for --yes so)."""
        t0 = time.monotonic()
        lease: Lease | None = None
        if not dry_run:
            try:
                lease = self.leases.take()
            except self.trouble as exc:
                log.warning("tier %s: collection skipped, lease request failed: %s", self.name, _brief(exc))
                self.metrics.error("gc")
                return GcResult(False, seconds=time.monotonic() - t0, reason="lease request failed")
            if lease is None:
                return GcResult(False, seconds=time.monotonic() - t0, reason="another collector holds the lease")
        try:
            try:
                entries = list_entries()
            except self.trouble as exc:
                log.warning("tier %s: collection could not list its objects: %s", self.name, _brief(exc))
                self.metrics.error("gc")
                return GcResult(False, seconds=time.monotonic() - t0, reason="listing failed")
            return self.sweep(entries, size, recency, delete, lease, dry_run, finish, t0, approve)
        finally:
            if lease is not None:
                self.leases.release(lease)

    def sweep(
        self,
        entries: list[E],
        size: Callable[[E], int],
        recency: Callable[[E], float],
        delete: Callable[[E], bool],
        lease: Lease | None,
        dry_run: bool,
        finish: Callable[[GcResult], GcResult] = lambda r: r,
        t0: float | None = None,
        approve: Callable[[GcResult], None] | None = None,
    ) -> GcResult:
        """The pass over listed ``entries`` under ``lease`` (held by the
        caller; None: none): deletes the policy's victims while the lease is
        valid, once ``approve`` (if given) returned on the plan."""
        t0 = time.monotonic() if t0 is None else t0
        total, victims = plan(self.policy(), entries, size, recency)
        if approve is not None:
            approve(GcResult(True, len(entries), total, len(victims), total - sum(size(e) for e in victims),
                             victims=tuple(victims)))
        after, deleted = total, 0
        for e in victims:
            if lease is not None and not lease.valid():
                log.warning("tier %s: collection stopped, its lease ran out (raise its lease time)", self.name)
                break
            if not dry_run:
                try:
                    if not delete(e):
                        continue  # gone meanwhile (or not ours to remove)
                except self.trouble as exc:
                    log.warning("tier %s: collection stopped, delete failed: %s", self.name, _brief(exc))
                    self.metrics.error("gc")
                    break
            after -= size(e)
            deleted += 1
        if not dry_run and deleted:
            self.metrics.evicted(deleted)
        result = finish(GcResult(True, len(entries), total, deleted, after,
                                 victims=tuple(victims) if dry_run else ()))
        return replace(result, seconds=time.monotonic() - t0)


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
