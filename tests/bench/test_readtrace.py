"""``ReadTrace``: each load's time with nothing in flight, split into its
start, the gaps between reads and its tail, from the AIO drivers' events;
``ReadTraces``, the observer that records them per tier."""

from __future__ import annotations

from kvtier.bench.readtrace import BEGIN, END, LoadIdle, ReadTraces, idle_per_load


def test_a_loads_idle_time_is_split_into_start_gaps_and_tail():
    events = [
        (0.0, BEGIN, 0),
        (1.0, "io", 2),  # nothing in flight for 1 s: the start
        (3.0, "io", -1),
        (4.0, "io", -1),  # all landed ...
        (5.0, "io", 1),  # ... for 1 s: a gap
        (6.0, "io", 1),  # submitted while one is in flight: no gap
        (7.0, "io", -2),
        (10.0, END, 0),  # 3 s after the last landing: the tail
    ]
    assert idle_per_load(events) == [LoadIdle(10.0, 1.0, 1.0, 3.0)]


def test_loads_without_reads_or_with_reads_left_in_flight():
    events = [
        (20.0, BEGIN, 0), (22.0, END, 0),  # served by no AIO read: all of it before a read
        (30.0, BEGIN, 0), (31.0, "io", 1), (33.0, END, 0),  # its read still in flight at the end: no tail
        (34.0, "io", -1),  # outside any load: ignored
    ]
    assert idle_per_load(events) == [LoadIdle(2.0, 2.0, 0.0, 0.0), LoadIdle(3.0, 1.0, 0.0, 0.0)]


def test_no_marked_load_gives_nothing():
    assert idle_per_load([(1.0, "io", 1), (2.0, "io", -1)]) == []


def test_the_recorder_keeps_each_watched_tiers_reads_apart_and_drops_the_others():
    traces, a, b, other = ReadTraces(), object(), object(), object()
    ta, tb = traces.watch(a), traces.watch(b)
    assert traces.watch(a) is ta  # one trace per tier
    assert traces.watches(a) and not traces.watches(other)
    traces.reads_submitted(a, 3, at=1.0)
    traces.reads_landed(b, 2, at=2.0)
    traces.reads_submitted(other, 5, at=3.0)
    assert ta._events == [(1.0, "io", 3)]
    assert tb._events == [(2.0, "io", -2)]
