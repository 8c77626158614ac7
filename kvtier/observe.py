"""The one hook through which the read path tells a benchmark what it does.

The directory tiers' AIO read streams report a few named events to the
module's ``observer``. The default one is inactive: a stream checks
``observer.active`` once, when it starts (``observed``), and reports
nothing, so a load in service pays one attribute check. A benchmark
installs its own (``installed``), whose ``active`` is true; what it records
and how it clocks it is the benchmark's (``kvtier/bench/readtrace.py``).
Operators' metrics do not go through here: they are counted where they
happen (``metrics.py``).

Events name their ``source``, the tier whose load made them, so that one
observer can tell several tiers apart.

Threads: events come from the tiers' driver threads, several at once; an
observer must be thread-safe and must not block. A stream keeps the
observer it found when it started, whatever is installed later.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Observer:
    """What the read path reports; this one listens to nothing."""

    active = False  # whether the read streams report to it at all

    def watches(self, source: object) -> bool:
        """Whether a load of ``source`` (a tier) that starts now reports to
        this observer (asked only of an active one)."""
        return self.active

    def reads_submitted(self, source: object, n: int, at: float | None = None) -> None:
        """``n`` reads (or pieces of reads) of ``source``'s load went to the
        kernel, now or ``at`` (``time.perf_counter()`` seconds: the native
        read loop clocks its own and hands them over at its end)."""

    def reads_landed(self, source: object, n: int, at: float | None = None) -> None:
        """``n`` reads (or pieces) of ``source``'s load landed, now or ``at``."""


observer: Observer = Observer()


def observed(source: object) -> Observer | None:
    """The observer a load of ``source`` that starts now reports to, or
    None (in service: no observer installed)."""
    obs = observer
    return obs if obs.active and obs.watches(source) else None


def install(new: Observer) -> Observer:
    """Make ``new`` the observer of loads that start from now on; returns
    the one it replaces."""
    global observer
    old, observer = observer, new
    return old


@contextmanager
def installed(new: Observer) -> Iterator[Observer]:
    """``new`` is the observer within the block; the one before it after."""
    old = install(new)
    try:
        yield new
    finally:
        install(old)
