"""``ReadTrace``: when a directory tier's AIO reads were in flight, against
when its loads began and ended; ``ReadTraces``, the observer
(``kvtier.observe``) that ``kvtier bench storage`` installs to record them,
one trace per tier. Nothing here runs in service.

Why: a load can read slower than the device for lack of reads in flight
(at its start, between batches, after its last read, while objects are
checked and copied), and the rate alone does not say which. The trace
splits each load's time with nothing in flight into those three parts
(``idle_per_load``); ``kvtier bench storage`` reports their medians for
the AIO path (docs/benchmarks.md).

Threads: the AIO drivers report their reads through the observer (``io``),
the load's caller marks its begin and end (``mark``); both append to one
list, which is safe under the GIL, and the events are sorted by time before
they are read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier.observe import Observer

BEGIN, END = "begin", "end"


@dataclass(frozen=True)
class LoadIdle:
    """One load's wall time, and the parts of it with no read in flight."""

    load_s: float
    start_s: float  # from the load's begin to its first read in flight
    between_s: float  # gaps between reads (the device had nothing to do)
    tail_s: float  # from the last read's landing to the load's end


class ReadTrace:
    def __init__(self):
        self._events: list[tuple[float, str, int]] = []  # (perf_counter, kind, reads: + submitted, - landed)

    def io(self, delta: int, at: float | None = None) -> None:
        """``delta`` reads (or pieces of reads) went to the kernel (> 0) or
        landed (< 0), now or ``at`` (``time.perf_counter()`` seconds: the
        native read loop records its own and hands them over at its end)."""
        self._events.append((time.perf_counter() if at is None else at, "io", delta))

    def mark(self, what: str) -> None:
        """A load begins (``BEGIN``) or ends (``END``)."""
        self._events.append((time.perf_counter(), what, 0))

    def clear(self) -> None:
        self._events = []

    def loads(self) -> list[LoadIdle]:
        return idle_per_load(sorted(self._events, key=lambda e: e[0]))


class ReadTraces(Observer):
    """The observer that records the reads of the tiers it ``watch``es, each
    in its own ``ReadTrace``; other tiers' reads are dropped. Install it
    with ``kvtier.observe.installed``."""

    active = True

    def __init__(self):
        self._traces: dict[int, tuple[object, ReadTrace]] = {}  # id(tier) -> (tier, its trace)

    def watch(self, tier: object) -> ReadTrace:
        """The trace of ``tier``'s reads from now on (one per tier)."""
        return self._traces.setdefault(id(tier), (tier, ReadTrace()))[1]

    def watches(self, source: object) -> bool:
        return self._of(source) is not None

    def _of(self, source: object) -> ReadTrace | None:
        held = self._traces.get(id(source))
        return held[1] if held is not None and held[0] is source else None

    def reads_submitted(self, source: object, n: int, at: float | None = None) -> None:
        trace = self._of(source)
        if trace is not None:
            trace.io(n, at)

    def reads_landed(self, source: object, n: int, at: float | None = None) -> None:
        trace = self._of(source)
        if trace is not None:
            trace.io(-n, at)


def idle_per_load(events: list[tuple[float, str, int]]) -> list[LoadIdle]:
    """Each load's idle parts from time-ordered events. A load with no read
    at all (served by another path) is all start; reads still in flight at a
    load's end (abandoned past a miss) leave it no tail."""
    out: list[LoadIdle] = []
    begin: float | None = None
    inflight = 0
    for t, kind, delta in events:
        if kind == BEGIN:
            begin, inflight, submitted = t, 0, False
            start = between = 0.0
            zero_since = t  # since when nothing is in flight
        elif begin is None:
            continue  # reads outside any marked load
        elif kind == "io":
            if delta > 0 and inflight == 0:
                if submitted:
                    between += t - zero_since
                else:
                    start, submitted = t - begin, True
            inflight = max(0, inflight + delta)
            if inflight == 0:
                zero_since = t
        elif kind == END:
            if not submitted:
                start, tail = t - begin, 0.0
            else:
                tail = t - zero_since if inflight == 0 else 0.0
            out.append(LoadIdle(t - begin, start, between, tail))
            begin = None
    return out
