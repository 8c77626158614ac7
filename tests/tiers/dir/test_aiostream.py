"""The O_DIRECT read path through native AIO (``AioStream``): it is the path
an ``o_direct`` directory tier really takes here, it serves what the
thread-per-read path serves, and every buffer it takes goes back to the
pool whatever happens to the load (a miss, a bad object, an abandoned
iteration, a timeout)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier.buffers import BufferPool, LoadBuffers, mapped_bytes
from kvtier.metrics import Metrics
from kvtier.tiers.dir import aio
from kvtier.tiers.dir.aiostream import AioStream
from kvtier.tiers.readstream import ReadStream
from kvtier.tiers.shared import SharedTier
from tests.support import OBJ, assert_object, flip_byte, make_chunks, shared_config

# In CI the kernel must offer it (these machines do): there a missing AIO fails instead of skipping.
pytestmark = pytest.mark.skipif(not aio.available() and not os.environ.get("CI"),
                                reason="this kernel offers no native AIO")


@pytest.fixture
def open_tier(tmp_path):
    opened = []

    def open_(aio_on=True, metrics=None, pool=None, **kw):
        kw.setdefault("read_window_bytes", 4 * OBJ)  # a few reads in flight: windows refill during a load
        kw.setdefault("native_reads", False)  # the Python driver (test_nativestream.py: the native loop)
        t = SharedTier(shared_config(tmp_path / "shared", 256 * OBJ, o_direct=True, aio=aio_on, **kw), metrics,
                       pool=pool)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.close()


def _payloads(tier, keys) -> list[bytes]:
    out = []
    for obj in tier.fetch(keys):
        assert_object(obj, keys[len(out)])
        out.append(bytes(obj.payload))
        obj.release()  # the consumer's reference (TieredStore does this through done_with)
    return out


class CountingPool(BufferPool):
    """A pool that knows how many bytes it ever allocated (it keeps them all)."""

    def __init__(self):
        super().__init__(64 << 20)
        self.fresh_bytes = 0

    def get(self, nbytes, direct_read=False):
        before = self.allocated
        buf = super().get(nbytes, direct_read)
        if self.allocated > before:
            self.fresh_bytes += mapped_bytes(buf)  # what the pool counts when it keeps it
        return buf


def _all_returned(pool: CountingPool, timeout: float = 5.0) -> bool:
    """Every buffer the pool ever handed out is back (the driver may still be
    reaping reads that landed after the consumer left)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pool.allocated and pool._kept == pool.fresh_bytes:
            return True
        time.sleep(0.01)
    return False


def test_o_direct_loads_take_the_aio_path_and_serve_what_threads_serve(open_tier):
    c = make_chunks(40)
    tier = open_tier()
    assert tier.store(c.objs) == 40
    stream = tier._stream(c.keys)
    assert isinstance(stream, AioStream), "o_direct with aio on must read through native AIO here"
    for obj in stream.iter(5.0):
        obj.release()
    assert tier.dir.direct_ok, "the test directory refused O_DIRECT: the AIO path was not exercised"
    with_aio = _payloads(tier, c.keys)
    threads = open_tier(aio_on=False)
    assert isinstance(threads._stream(c.keys[:1]), ReadStream)
    assert with_aio == _payloads(threads, c.keys) == c.payloads


def test_a_load_stops_at_the_first_missing_object_and_returns_every_buffer(open_tier):
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(30)
    tier.store(c.objs)
    tier.delete([c.keys[17]])
    assert len(_payloads(tier, c.keys)) == 17
    assert _all_returned(pool)


def test_a_bad_object_ends_the_load_there_is_quarantined_and_counted(open_tier):
    metrics = Metrics()
    pool = CountingPool()
    tier = open_tier(metrics=metrics, pool=pool, read_window_bytes=64 * OBJ)  # reads past the bad one in flight
    c = make_chunks(30)
    tier.store(c.objs)
    path = tier.dir.path(c.keys[9])
    flip_byte(path, 4096 + 10)
    assert len(_payloads(tier, c.keys)) == 9
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
    assert not path.exists()
    assert _all_returned(pool)


def test_an_abandoned_load_returns_every_buffer(open_tier):
    pool = CountingPool()
    tier = open_tier(pool=pool, read_window_bytes=64 * OBJ)
    c = make_chunks(60)
    tier.store(c.objs)
    it = tier.fetch(c.keys)
    got = [next(it) for _ in range(3)]
    it.close()  # the engine gave up on the rest
    for o in got:
        o.release()
    assert _all_returned(pool)
    assert len(_payloads(tier, c.keys)) == 60  # and the tier serves the next load whole


def test_a_slow_read_times_out_the_load_and_its_buffers_come_back_later(open_tier):
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(8)
    tier.store(c.objs)
    release = threading.Event()
    finish = tier._finish_read

    def slow_finish(key, op, got, t0, pool):  # the 4th object "lands" only when released
        if key == c.keys[3]:
            release.wait(10)
        return finish(key, op, got, t0, pool)

    stream = AioStream(tier.executor, c.keys, tier._begin_read, slow_finish, tier._read_one, pool,
                       4 * OBJ, lambda: tier._bytes_per_token)
    t0 = time.monotonic()
    got = list(stream.iter(0.5))
    waited = time.monotonic() - t0
    assert len(got) == 3 and stream.failed is not None
    assert waited < 3, waited
    for o in got:
        o.release()
    release.set()
    assert _all_returned(pool)


@pytest.mark.parametrize("cut", [None, 4096 + 100, 4096])
def test_objects_read_in_pieces_arrive_whole_and_a_cut_file_is_caught(open_tier, cut):
    """Each 8 KiB object read as two 4 KiB requests: the bytes are the
    object's; a file cut inside or at the end of its first piece is a bad
    object (quarantined), never a short payload."""
    metrics = Metrics()
    pool = CountingPool()
    tier = open_tier(metrics=metrics, pool=pool, read_window_bytes=16 * OBJ)
    c = make_chunks(12)
    tier.store(c.objs)
    if cut is not None:
        os.truncate(tier.dir.path(c.keys[5]), cut)
    stream = AioStream(tier.executor, c.keys, tier._begin_read, tier._finish_read, tier._read_one, pool,
                       16 * OBJ, lambda: tier._bytes_per_token, piece_bytes=4096)
    got = []
    for obj in stream.iter(5.0):
        assert_object(obj, c.keys[len(got)])
        got.append(obj)
        obj.release()
    assert len(got) == (12 if cut is None else 5)
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == (0 if cut is None else 1)
    assert _all_returned(pool)


def test_a_driver_that_cannot_start_fails_the_load_and_the_request_recomputes(open_tier, monkeypatch):
    """io_setup refused (the system's AIO request limit reached): the load
    ends as failed, nothing is handed out, and nothing leaks."""
    def refuse(depth):
        raise OSError(11, "io_setup: Resource temporarily unavailable")

    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(4)
    tier.store(c.objs)
    monkeypatch.setattr(aio, "AioContext", refuse)  # where the stream's own context pool makes them
    stream = AioStream(tier.executor, c.keys, tier._begin_read, tier._finish_read, tier._read_one, pool,
                       4 * OBJ, lambda: tier._bytes_per_token)
    assert list(stream.iter(5.0)) == []
    assert isinstance(stream.failed, OSError)
    assert pool.allocated == 0


def test_loads_reuse_their_aio_contexts_and_the_tier_frees_them(open_tier, monkeypatch):
    made = []
    init = aio.AioContext.__init__

    def counting_init(self, depth):
        init(self, depth)
        made.append(self)

    monkeypatch.setattr(aio.AioContext, "__init__", counting_init)
    tier = open_tier()
    c = make_chunks(12)
    tier.store(c.objs)
    for _ in range(5):  # one after the other: each driver gives its context back before the next takes one
        assert _payloads(tier, c.keys) == c.payloads
        end = time.monotonic() + 5
        while not tier._aio_contexts._free and time.monotonic() < end:
            time.sleep(0.005)
    assert len(made) == 1 and made[0].inflight == 0
    tier.close()
    assert made[0]._closed


def _held_stream(tier, c, verifiers, into=None):
    """A stream over every object at once whose verifications all wait at a
    gate; returns it, the gate, the indices in the order verification
    started, and the peak of verifications running together."""
    gate, lock = threading.Event(), threading.Lock()
    started, running, peak = [], [0], [0]

    def finish(key, op, got, t0, pool):
        with lock:
            started.append(c.keys.index(key))
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(10)
        try:
            return tier._finish_read(key, op, got, t0, pool)
        finally:
            with lock:
                running[0] -= 1

    stream = AioStream(tier.executor, c.keys, tier._begin_read, finish, tier._read_one, tier.pool,
                       64 * OBJ, lambda: tier._bytes_per_token, verifiers=verifiers, into=into)
    end = time.monotonic() + 10
    while stream._verifying < len(c.keys) and time.monotonic() < end:  # every read landed
        time.sleep(0.005)
    assert stream._verifying == len(c.keys)
    return stream, gate, started, peak


def test_landed_reads_are_verified_lowest_index_first(open_tier):
    """Reads land together (a window in flight at once): the consumer's next
    object is verified first, not whichever landed first."""
    tier = open_tier()
    c = make_chunks(12)
    tier.store(c.objs)
    stream, gate, started, peak = _held_stream(tier, c, verifiers=1)
    assert len(started) == 1  # one job, held with the one object it took
    gate.set()
    got = []
    for obj in stream.iter(10.0):
        got.append(bytes(obj.payload))
        obj.release()
    assert got == c.payloads
    assert started[1:] == sorted(started[1:]) and sorted(started) == list(range(12))
    assert peak[0] == 1


def test_verifications_run_side_by_side_up_to_the_bound(open_tier):
    tier = open_tier()
    c = make_chunks(12)
    tier.store(c.objs)
    stream, gate, started, peak = _held_stream(tier, c, verifiers=3)
    time.sleep(0.05)  # were a job per object started, more would be waiting at the gate by now
    assert peak[0] == 3
    gate.set()
    assert [bytes(o.payload) for o in stream.iter(10.0)] == c.payloads
    assert peak[0] == 3


def test_a_traced_load_records_every_read_it_submitted_landing(open_tier, read_traces):
    from kvtier.bench.readtrace import BEGIN, END

    tier = open_tier()
    c = make_chunks(10)
    tier.store(c.objs)
    trace = read_traces.watch(tier)
    trace.mark(BEGIN)
    assert _payloads(tier, c.keys) == c.payloads
    trace.mark(END)
    ios = [d for _, kind, d in trace._events if kind == "io"]
    assert sum(d for d in ios if d > 0) >= 10 and sum(ios) == 0  # every piece submitted landed
    (load,) = trace.loads()
    assert 0 <= load.start_s + load.between_s + load.tail_s <= load.load_s


def test_a_window_smaller_than_an_object_keeps_two_reads_in_flight(open_tier, read_traces):
    """However small the window, two objects are in flight: with one, each
    read would wait for the one before it to land."""
    from kvtier.tiers.readstream import MIN_INFLIGHT

    tier = open_tier(read_window_bytes=OBJ // 2)
    c = make_chunks(8)
    tier.store(c.objs)
    trace = read_traces.watch(tier)
    assert _payloads(tier, c.keys) == c.payloads
    running, peak = 0, 0
    for _, kind, d in trace._events:
        if kind == "io":
            running += d
            peak = max(peak, running)
    assert peak == MIN_INFLIGHT == 2  # one piece per object: no more than the floor either


def test_a_load_keeps_a_quarter_of_what_is_left_off_the_device_so_its_last_reads_land_few(open_tier, monkeypatch):
    """Reads in flight together land together, and each is checked once
    landed: with the whole load in flight, the load would end with every
    object's check. Tapered (three quarters of what has not landed), the
    reads land in shrinking batches, each checked while the next is read."""
    tier = open_tier(read_window_bytes=64 * OBJ)  # room for the whole load
    c = make_chunks(16)
    tier.store(c.objs)
    assert _payloads(tier, c.keys[:1]) == c.payloads[:1]  # the tier learns its objects' size
    seen = []  # reads in flight whenever the driver waits for some to land
    reap = aio.AioContext.reap

    def slow_reap(ctx, min_nr, timeout_s):
        seen.append(ctx.inflight)
        time.sleep(0.02)  # every read in flight has landed by then
        return reap(ctx, min_nr, timeout_s)

    monkeypatch.setattr(aio.AioContext, "reap", slow_reap)
    assert _payloads(tier, c.keys) == c.payloads
    assert seen[0] == 12  # not 16: three quarters of the load
    assert seen[1:] == [3, 1]  # then three quarters of the four left, then the last


def _bufs(c) -> list[memoryview]:
    return [memoryview(bytearray(len(p))) for p in c.payloads]


def test_fetch_into_copies_each_object_on_the_job_that_verified_it(open_tier, monkeypatch):
    """The caller's buffers are filled where objects are verified, on the
    tier's pool, not one after the other on the consumer's thread."""
    import kvtier.tiers.dir.aiostream as aiostream

    copiers, real = [], aiostream.copy_into
    monkeypatch.setattr(aiostream, "copy_into", lambda dst, src: (copiers.append(threading.get_ident()), real(dst, src)))
    tier = open_tier()
    c = make_chunks(10)
    tier.store(c.objs)
    bufs = _bufs(c)
    n = 0
    for obj in tier.fetch_into(c.keys, bufs):
        assert bytes(bufs[n]) == c.payloads[n]  # in place before it is handed over
        obj.release()
        n += 1
    assert n == 10 and [bytes(b) for b in bufs] == c.payloads
    assert len(copiers) == 10 and threading.get_ident() not in copiers


def test_fetch_into_ends_at_a_buffer_of_another_size(open_tier):
    tier = open_tier()
    c = make_chunks(6)
    tier.store(c.objs)
    bufs = _bufs(c)
    bufs[3] = memoryview(bytearray(len(c.payloads[3]) + 1))
    got = []
    for obj in tier.fetch_into(c.keys, bufs):
        got.append(bytes(obj.payload))
        obj.release()
    assert got == c.payloads[:3]
    assert [bytes(b) for b in bufs[:3]] == c.payloads[:3]


def test_nothing_is_copied_into_the_callers_buffers_once_it_stopped(open_tier):
    """A verification that ends after the consumer stopped (a timeout, an
    abandoned load) leaves the caller's buffers alone: the engine may have
    given them to another request by then."""
    tier = open_tier()
    c = make_chunks(6)
    tier.store(c.objs)
    bufs = _bufs(c)
    stream, gate, started, _ = _held_stream(tier, c, verifiers=1, into=bufs)
    assert started == [0]  # one verification under way, held at the gate
    stream.stop(0)
    gate.set()
    end = time.monotonic() + 10
    while stream._verifying and time.monotonic() < end:
        time.sleep(0.005)
    assert stream._verifying == 0
    assert all(not any(bytes(b)) for b in bufs)  # verified, and not copied


def test_stop_returns_only_once_a_copy_under_way_ended(open_tier, monkeypatch):
    import kvtier.tiers.dir.aiostream as aiostream

    began, ended, real = threading.Event(), threading.Event(), aiostream.copy_into

    def slow_copy(dst, src):
        began.set()
        time.sleep(0.3)
        real(dst, src)
        ended.set()

    monkeypatch.setattr(aiostream, "copy_into", slow_copy)
    tier = open_tier()
    c = make_chunks(1)
    tier.store(c.objs)
    stream = AioStream(tier.executor, c.keys, tier._begin_read, tier._finish_read, tier._read_one, tier.pool,
                       64 * OBJ, lambda: tier._bytes_per_token, into=_bufs(c))
    assert began.wait(10)
    stream.stop(0)
    assert ended.is_set()


# ---------------------------------------------------------------- lent buffers


def test_a_load_into_lent_buffers_reads_each_object_in_its_slot_and_copies_nothing(open_tier, monkeypatch):
    import kvtier.tiers.dir.aiostream as aiostream

    copies, real = [], aiostream.copy_into
    monkeypatch.setattr(aiostream, "copy_into", lambda dst, src: (copies.append(1), real(dst, src)))
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(10)
    tier.store(c.objs)
    lb = LoadBuffers(pool, 10, len(c.payloads[0]))
    landed = []
    for i, obj in enumerate(tier.fetch_into(c.keys, lb)):
        landed.append(obj.buf.obj is lb._bufs[i].obj)  # the object is its slot
        obj.release()
    assert landed == [True] * 10 and not copies
    assert [bytes(lb.payload(i)) for i in range(10)] == c.payloads
    assert not any(lb._busy)  # every slot given back: the next load reads into the same buffers
    assert tier.load(c.keys[:4], lb) == 4 and not copies


def test_a_read_that_lands_after_the_load_gave_up_lands_in_a_slot_the_next_load_does_not_use(open_tier):
    """The reason buffers are lent and not the caller's own: a late read
    writes where nobody looks any more, and its buffer goes back to the pool
    only once it landed."""
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(6)
    tier.store(c.objs)
    lb = LoadBuffers(pool, 6, len(c.payloads[0]))
    release, finish = threading.Event(), tier._finish_read

    def slow_finish(key, op, got, t0, pool):  # the 4th object's read "lands" only when released
        if key == c.keys[3]:
            release.wait(10)
        return finish(key, op, got, t0, pool)

    stream = AioStream(tier.executor, c.keys, tier._begin_read, slow_finish, tier._read_one, pool,
                       64 * OBJ, lambda: tier._bytes_per_token, into=lb)
    got = list(stream.iter(0.5))
    assert len(got) == 3 and stream.failed is not None
    for o in got:
        o.release()
    late = lb._bufs[3]
    assert lb._busy[3]  # still the late read's
    dst = lb.writable(3)  # the next load, copying into slot 3
    assert dst.obj is not late.obj
    dst[:] = b"\x07" * dst.nbytes
    kept = pool._kept
    release.set()
    end = time.monotonic() + 10
    while pool._kept == kept and time.monotonic() < end:  # the late object was let go
        time.sleep(0.005)
    assert pool._kept == kept + mapped_bytes(late)
    assert bytes(lb.payload(3)) == b"\x07" * dst.nbytes and lb._bufs[3].obj is dst.obj
    # The next load reads every slot again, the new buffer of slot 3 included.
    assert tier.load(c.keys, lb) == 6 and [bytes(lb.payload(i)) for i in range(6)] == c.payloads
