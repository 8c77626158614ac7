"""``ReadStream``, the windowed reader of the tiers that read one object per
call: how many reads it keeps in flight."""

from __future__ import annotations

import threading

from kvtier.concurrency.executor import PriorityExecutor
from kvtier.tiers.readstream import MIN_INFLIGHT, ReadStream
from tests.support import OBJ, make_chunks


def test_a_window_smaller_than_an_object_keeps_two_reads_in_flight():
    c = make_chunks(6)
    by_key = dict(zip(c.keys, c.objs))
    both = threading.Barrier(MIN_INFLIGHT, timeout=10)  # broken (an error, a miss) unless two reads meet
    lock, running, peak, calls = threading.Lock(), [0], [0], [0]

    def read_one(key):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            calls[0] += 1
            first = calls[0] <= MIN_INFLIGHT
        try:
            if first:
                both.wait()
            return by_key[key].retain()
        finally:
            with lock:
                running[0] -= 1

    ex = PriorityExecutor("test-read", 4)
    try:
        stream = ReadStream(ex, c.keys, read_one, 1, lambda: OBJ)
        got = []
        for obj in stream.iter(10.0):
            got.append(bytes(obj.payload))
            obj.release()
        assert stream.failed is None
        assert got == c.payloads
        assert peak[0] == MIN_INFLIGHT == 2
    finally:
        ex.close()
