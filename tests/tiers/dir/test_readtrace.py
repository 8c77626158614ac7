"""``ReadTrace``: each load's time with nothing in flight, split into its
start, the gaps between reads and its tail, from the AIO driver's events."""

from __future__ import annotations

from kvtier.tiers.dir.readtrace import BEGIN, END, LoadIdle, idle_per_load


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
