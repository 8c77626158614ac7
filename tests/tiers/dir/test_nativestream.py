"""The native read loop (``NativeStream``, kvtier/_native/readloop.c): it is
the path an ``o_direct`` directory tier takes here, it serves what the
Python driver serves, what it cannot settle is read the ordinary way
(a bad object quarantined, an object of another size served), and every
buffer and descriptor it takes goes back whatever happens to the load (a
miss, an abandoned iteration, a timeout on a hung mount)."""

from __future__ import annotations

import os
import time

import pytest

from kvtier import observe
from kvtier.bench.readtrace import BEGIN, END, ReadTrace, ReadTraces
from kvtier.buffers import LoadBuffers
from kvtier.metrics import Metrics
from kvtier.tiers.dir import nativestream
from kvtier.tiers.dir.aiostream import AioStream
from kvtier.tiers.dir.nativestream import NativeStream
from kvtier.tiers.readstream import MIN_INFLIGHT
from kvtier.tiers.shared import SharedTier
from tests.support import OBJ, assert_object, flip_byte, make_chunks, shared_config
from tests.tiers.dir.test_aiostream import CountingPool, _all_returned, _payloads


def _can_build() -> bool:
    """A C compiler and Python's headers: what setup.py needs to build the loop."""
    import shutil
    import sysconfig

    include = sysconfig.get_paths()["include"]
    return shutil.which("cc") is not None and os.path.exists(os.path.join(include, "Python.h"))


# Built wherever it can be (the test below fails where it could and was
# not): only a machine without a C compiler or Python's headers skips these.
pytestmark = pytest.mark.skipif(not nativestream.available() and not _can_build(),
                                reason="no C compiler or Python headers: the native read loop is not built here")


def test_the_native_loop_is_built_where_it_can_be():
    """``make venv`` builds it (setup.py) where a compiler and Python's
    headers are at hand (this project's machines): were the build to fail
    silently there, every load would take the Python driver, and this
    fails instead."""
    assert nativestream.available() or not _can_build()


def test_the_loop_checks_with_the_checksum_the_format_names():
    """The loop calls XXH3-128 from the ``xxhash`` package's own library:
    its digest, in the format's byte order, is ``codec.payload_checksum``'s."""
    import ctypes

    from kvtier.codec import payload_checksum

    class H(ctypes.Structure):
        _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]

    fn = ctypes.CFUNCTYPE(H, ctypes.c_void_p, ctypes.c_size_t)(nativestream._xxh3_128_address())
    for n in (1, 4095, 3 << 20):
        data = os.urandom(n)
        buf = ctypes.create_string_buffer(data, n)
        h = fn(ctypes.addressof(buf), n)
        assert h.high64.to_bytes(8, "big") + h.low64.to_bytes(8, "big") == payload_checksum(data)


@pytest.fixture
def open_tier(tmp_path):
    opened = []

    def open_(metrics=None, pool=None, path=None, **kw):
        kw.setdefault("read_window_bytes", 4 * OBJ)  # a few reads in flight: windows refill during a load
        t = SharedTier(shared_config(path or tmp_path / "shared", 256 * OBJ, o_direct=True, **kw), metrics, pool=pool)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _no_fd_leak(before: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _fds() <= before:
            return True
        time.sleep(0.01)
    return False


def test_loads_take_the_native_loop_and_serve_what_the_python_driver_serves(open_tier):
    c = make_chunks(40)
    metrics = Metrics()
    tier = open_tier(metrics=metrics)
    assert tier.store(c.objs) == 40
    stream = tier._stream(c.keys)
    assert isinstance(stream, NativeStream), "o_direct with aio on must read through the native loop here"
    got = _taken(stream, keep=True)
    assert [bytes(o.payload) for o in got] == c.payloads
    for o in got:
        o.release()
    assert tier.dir.direct_ok, "the test directory refused O_DIRECT: the native loop was not exercised"
    python = open_tier(path=tier.dir.root, native_reads=False, metrics=metrics)
    assert isinstance(python._stream(c.keys[:1]), AioStream)
    assert _payloads(tier, c.keys) == _payloads(python, c.keys) == c.payloads
    assert metrics.value("kvtier_load_drivers_total", tier=tier.name, driver="native") == 2
    assert metrics.value("kvtier_load_drivers_total", tier=tier.name, driver="aio") == 2


def _taken(stream, keep: bool = False) -> list:
    """The objects a stream yields, checked and released (``keep``: not
    released, the caller's to release)."""
    out = []
    for obj in stream.iter(5.0):
        out.append(obj)
        if not keep:
            obj.release()
    return out


def test_a_load_into_lent_buffers_reads_each_object_in_its_slot(open_tier):
    tier = open_tier()
    c = make_chunks(12)
    tier.store(c.objs)
    into = LoadBuffers(tier.pool, 12, len(c.payloads[0]))
    stream = tier._stream(c.keys, into)
    assert isinstance(stream, NativeStream) and stream.delivers
    got = _taken(stream, keep=True)
    assert len(got) == 12
    assert [bytes(into.payload(i)) for i in range(12)] == c.payloads
    assert all(into.lender(i).holds(o.buf) for i, o in enumerate(got))  # read in place, not copied
    for o in got:
        o.release()


def test_a_load_stops_at_the_first_missing_object_and_returns_every_buffer_and_descriptor(open_tier):
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(30)
    tier.store(c.objs)
    tier.delete([c.keys[17]])
    before = _fds()
    assert len(_payloads(tier, c.keys)) == 17
    assert _all_returned(pool)
    assert _no_fd_leak(before)


def test_nothing_past_a_missing_object_is_read(open_tier, read_traces):
    """The loop opens objects in key order: one that is not there ends the
    load, and no object past it is opened or read (as the Python driver)."""
    tier = open_tier(read_window_bytes=64 * OBJ)  # room for every read at once
    c = make_chunks(30)
    tier.store(c.objs)
    tier.delete([c.keys[5]])
    trace = read_traces.watch(tier)
    assert len(_payloads(tier, c.keys)) == 5
    assert sum(d for _, kind, d in trace._events if kind == "io" and d > 0) == 5


def test_an_object_written_again_after_the_loop_missed_it_is_served_and_the_load_ends_there(open_tier, monkeypatch):
    """Another process writes an object back between the loop's open (a
    miss: nothing past it is read) and the ordinary read of that miss: it
    is served, and the load ends after it as at a miss, not as a failure."""
    pool = CountingPool()
    tier = open_tier(pool=pool, read_window_bytes=64 * OBJ)
    c = make_chunks(12)
    tier.store(c.objs)
    tier.delete([c.keys[4]])
    read_one = tier._read_one

    def written_back(key, **kw):
        if key == c.keys[4]:
            tier.store([c.objs[4]])
        return read_one(key, **kw)

    monkeypatch.setattr(tier, "_read_one", written_back)
    stream = tier._stream(c.keys)
    assert isinstance(stream, NativeStream)
    got = _taken(stream, keep=True)
    assert [bytes(o.payload) for o in got] == c.payloads[:5]
    assert stream.failed is None
    for o in got:
        o.release()
    assert _all_returned(pool)


def test_a_bad_object_is_read_again_the_ordinary_way_quarantined_and_counted(open_tier):
    metrics = Metrics()
    pool = CountingPool()
    tier = open_tier(metrics=metrics, pool=pool, read_window_bytes=64 * OBJ)  # reads past the bad one in flight
    c = make_chunks(30)
    tier.store(c.objs)
    path = tier.dir.path(c.keys[9])
    flip_byte(path, 4096 + 10)
    before = _fds()
    stream = tier._stream(c.keys[:1])
    assert isinstance(stream, NativeStream)
    stream.stop()
    assert len(_payloads(tier, c.keys)) == 9
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
    assert not path.exists()
    assert _all_returned(pool)
    assert _no_fd_leak(before)


@pytest.mark.parametrize("where", ["header", "crc", "padding"])
def test_damage_the_loop_does_not_check_is_caught_by_the_header_check(open_tier, where):
    """A damaged header is not the one the loop expects (nor is its CRC-32
    right): ``codec.decode`` parses it and refuses it, as on every path; a
    damaged padding fails the loop's own check (read again the ordinary
    way, refused there)."""
    metrics = Metrics()
    tier = open_tier(metrics=metrics)
    c = make_chunks(6)
    tier.store(c.objs)
    path = tier.dir.path(c.keys[2])
    # A namespace byte; the header's CRC-32; the header block's zero padding.
    flip_byte(path, {"header": 100, "crc": 213, "padding": 1000}[where], 0x01)
    assert len(_payloads(tier, c.keys)) == 2
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1


def test_the_loop_takes_only_writable_buffers_of_its_objects_length():
    """A buffer is given to the loop as a buffer, not an address: one too
    short for its object, or read-only, is refused before any read could
    land past its end."""
    from kvtier.buffers import alloc
    from kvtier.tiers.dir.aio import AioContext

    nativestream.available()
    ctx = AioContext(64)
    try:
        load = nativestream._readloop.Load([b"a", b"b"], [8192, 8192], ctx.id, ctx.depth, 1 << 20, 0.75, 2,
                                           4 << 20, 0.05, False)
        with pytest.raises(ValueError):
            load.give(0, [alloc(4096)])
        with pytest.raises(BufferError):
            load.give(0, [bytes(8192)])
        with pytest.raises(IndexError):
            load.give(1, [alloc(8192), alloc(8192)])
        load.give(0, [alloc(8192), alloc(8192)])
        with pytest.raises(ValueError):
            load.give(1, [alloc(8192)])  # already given
    finally:
        ctx.close()


def test_the_loop_opens_each_object_at_its_path(open_tier):
    """The paths handed to the loop (below the store's folder) name the
    files ``ObjectDir.path`` names."""
    tier = open_tier()
    for k in make_chunks(5).keys:
        assert tier.dir.base / tier.dir.rel_path(k).decode() == tier.dir.path(k)


def _count_parses(monkeypatch) -> list:
    """Every header ``codec.decode`` parses from now on."""
    from kvtier import codec

    parsed = []
    real = codec.parse_header

    def counted(block):
        parsed.append(1)
        return real(block)

    monkeypatch.setattr(codec, "parse_header", counted)
    return parsed


def test_a_header_as_expected_is_not_parsed_again(open_tier, monkeypatch):
    """Once the tier knows a namespace's layout (here from its writes), the
    loop compares each header with the one ``codec.expected_head`` gives
    for the key, and its CRC-32 (computed in C, zlib's): the objects come
    out with the header ``codec.decode`` would have parsed, none parsed."""
    tier = open_tier()
    c = make_chunks(12)
    tier.store(c.objs)
    parsed = _count_parses(monkeypatch)
    got = _taken(tier._stream(c.keys), keep=True)
    assert parsed == []
    for o, k, written in zip(got, c.keys, c.objs):
        assert o.header == written.header
        assert_object(o, k)
        o.release()


def test_a_header_other_than_expected_is_parsed_and_served_as_it_is(open_tier, monkeypatch):
    """A valid object of another layout than the one the tier learned for
    its namespace and token count (here the same payload length, another
    shape) is parsed by ``codec.decode`` and served with its own header."""
    from kvtier.codec import encode
    from tests.support import DTYPE, payload_for

    tier = open_tier()
    c = make_chunks(6)
    tier.store(c.objs[:3])
    shape = tuple(reversed(c.objs[0].header.shape))
    tier.store([encode(k, DTYPE, shape, payload_for(k)) for k in c.keys[3:]])
    parsed = _count_parses(monkeypatch)
    got = _taken(tier._stream(c.keys), keep=True)
    assert len(parsed) == 3
    assert [o.header.shape for o in got] == [c.objs[0].header.shape] * 3 + [shape] * 3
    for o, k in zip(got, c.keys):
        assert_object(o, k)
        o.release()


def test_a_header_naming_another_key_is_refused_even_with_a_right_crc(open_tier):
    """A header whose CRC-32 was made right again after its key check
    changed (a naming collision, or a forged object) is not the one
    expected: parsed, refused, quarantined."""
    import zlib

    metrics = Metrics()
    tier = open_tier(metrics=metrics)
    c = make_chunks(6)
    tier.store(c.objs)
    path = tier.dir.path(c.keys[2])
    flip_byte(path, 50, 0x01)  # a byte of the key check (offsets: kvtier/codec.py)
    with open(path, "r+b") as f:
        head = f.read(212)
        f.seek(212)
        f.write(zlib.crc32(head).to_bytes(4, "little"))
    assert len(_payloads(tier, c.keys)) == 2
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
    assert not path.exists()


def test_objects_of_a_size_other_than_expected_are_read_the_ordinary_way(open_tier):
    """The loop reads an object into a buffer of the length the tier
    expects; a file of another length is not its to judge: it is served by
    the ordinary read (here every object, as if a token's bytes changed)."""
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(6)
    tier.store(c.objs)
    ns = c.keys[0].ns
    tier._payload_per_token[ns] *= 2  # every object is now shorter than its buffer
    stream = tier._stream(c.keys)
    assert isinstance(stream, NativeStream)
    got = _taken(stream, keep=True)
    assert [bytes(o.payload) for o in got] == c.payloads
    for o, k in zip(got, c.keys):
        assert_object(o, k)
        o.release()
    assert _all_returned(pool)


def test_two_models_on_one_tier_are_each_read_by_the_loop(open_tier, monkeypatch):
    """A shared tier holds several models' chunks, of different bytes per
    token: each namespace's object lengths are learned apart, so loads of
    either go through the loop and none is read twice (the loop reads into
    buffers of the wrong length, then the ordinary read again)."""
    import dataclasses

    from kvtier.codec import encode
    from kvtier.keys import chunk_keys
    from tests.support import DTYPE, NS, payload_for, tokens_for

    big = dataclasses.replace(NS, model="test/other", num_kv_heads=8)  # 4x the bytes per token
    c = make_chunks(6)
    big_keys = chunk_keys(big, tokens_for(7, 6 * big.chunk_tokens))
    big_shape = (big.num_layers, 2, big.num_kv_heads, big.chunk_tokens, big.head_dim)
    nbytes = len(payload_for(c.keys[0])) * 4
    tier = open_tier()
    tier.store(c.objs)
    tier.store([encode(k, DTYPE, big_shape, payload_for(k, nbytes)) for k in big_keys])
    fallbacks = []
    ordinary = NativeStream._ordinary

    def counted(self, i, key, deadline):
        fallbacks.append(key)
        return ordinary(self, i, key, deadline)

    monkeypatch.setattr(NativeStream, "_ordinary", counted)
    for keys, want in ((c.keys, c.payloads), (big_keys, [payload_for(k, nbytes) for k in big_keys])) * 2:
        stream = tier._stream(keys)
        assert isinstance(stream, NativeStream)
        got = _taken(stream, keep=True)
        assert [bytes(o.payload) for o in got] == want
        for o in got:
            o.release()
    assert fallbacks == []


def test_the_loop_closes_the_files_of_objects_that_owe_no_stamp(open_tier):
    """An object stamped within the tier's interval owes no recency stamp:
    the loop closes its file as it verifies it, and the consumer gets no
    descriptor for it. A stale object's file stays open for its stamp, made
    through it once the load's consumer is done."""
    tier = open_tier(touch_interval_s=60)
    c = make_chunks(4)
    tier.store(c.objs)
    now = time.time()
    for k in c.keys[2:]:
        os.utime(tier.dir.path(k), (now - 120, now - 120))
    before = _fds()
    stream = tier._stream(c.keys)
    assert isinstance(stream, NativeStream)
    fds = []
    for i, obj in enumerate(stream.iter(5.0)):
        fds.append(stream._load.item(i)[2])
        obj.release()
    assert fds[:2] == [-1, -1] and min(fds[2:]) >= 0
    assert tier._owed.settle(5.0)
    assert [os.stat(tier.dir.path(k)).st_mtime > now - 60 for k in c.keys] == [True] * 4
    assert _no_fd_leak(before)


def test_an_abandoned_load_returns_every_buffer_and_descriptor(open_tier):
    pool = CountingPool()
    tier = open_tier(pool=pool, read_window_bytes=64 * OBJ)
    c = make_chunks(60)
    tier.store(c.objs)
    before = _fds()
    it = tier.fetch(c.keys)
    got = [next(it) for _ in range(3)]
    it.close()  # the engine gave up on the rest
    for o in got:
        o.release()
    assert _all_returned(pool)
    assert _no_fd_leak(before)
    assert len(_payloads(tier, c.keys)) == 60  # and the tier serves the next load whole


@pytest.mark.parametrize("cut", [None, 4096 + 100, 4096])
def test_objects_read_in_pieces_arrive_whole_and_a_cut_file_is_caught(open_tier, cut):
    metrics = Metrics()
    pool = CountingPool()
    tier = open_tier(metrics=metrics, pool=pool, read_window_bytes=16 * OBJ)
    c = make_chunks(12)
    tier.store(c.objs)
    if cut is not None:
        os.truncate(tier.dir.path(c.keys[5]), cut)
    base = tier.dir.base_handle()
    stream = NativeStream(tier.executor, c.keys, [tier.dir.rel_path(k) for k in c.keys], [OBJ] * 12, base.fd,
                          tier._finish_read, tier._read_one, pool, 16 * OBJ, tier._aio_contexts,
                          ended=base.close, piece_bytes=4096)
    got = []
    for obj in stream.iter(5.0):
        assert_object(obj, c.keys[len(got)])
        got.append(obj)
        obj.release()
    assert len(got) == (12 if cut is None else 5)
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == (0 if cut is None else 1)
    assert _all_returned(pool)


def _peak(trace: ReadTrace) -> list[int]:
    """Reads in flight after each event of the trace."""
    running, out = 0, []
    for _, kind, d in sorted(trace._events):
        if kind == "io":
            running += d
            out.append(running)
    return out


def test_a_traced_load_records_every_read_it_submitted_landing(open_tier, read_traces):
    tier = open_tier()
    c = make_chunks(10)
    tier.store(c.objs)
    trace = read_traces.watch(tier)
    trace.mark(BEGIN)
    assert _payloads(tier, c.keys) == c.payloads
    trace.mark(END)
    ios = [d for _, kind, d in trace._events if kind == "io"]
    assert sum(d for d in ios if d > 0) == 10 and sum(ios) == 0  # every read submitted landed
    (load,) = trace.loads()
    assert 0 <= load.start_s + load.between_s + load.tail_s <= load.load_s


def test_a_window_smaller_than_an_object_keeps_two_reads_in_flight(open_tier, read_traces):
    tier = open_tier(read_window_bytes=OBJ // 2)
    c = make_chunks(8)
    tier.store(c.objs)
    trace = read_traces.watch(tier)
    assert _payloads(tier, c.keys) == c.payloads
    assert max(_peak(trace)) == MIN_INFLIGHT == 2


def test_a_load_keeps_a_quarter_of_what_is_left_off_the_device(open_tier, read_traces):
    """As the Python driver's (_TAPER): at most three quarters of what has
    not landed yet is in flight, so the load's last reads land few."""
    tier = open_tier(read_window_bytes=64 * OBJ)  # room for the whole load
    c = make_chunks(16)
    tier.store(c.objs)
    trace = read_traces.watch(tier)
    assert _payloads(tier, c.keys) == c.payloads
    first_landing = next(i for i, (_, kind, d) in enumerate(sorted(trace._events)) if kind == "io" and d < 0)
    assert _peak(trace)[first_landing - 1] == 12  # not 16


def test_only_a_watched_tiers_loads_tell_the_installed_observer(open_tier, tmp_path):
    """The read path reports its reads to the observer installed when a load
    starts, for the tiers it watches; with none installed (in service) and
    for other tiers, nothing is recorded."""
    watched, other = open_tier(), open_tier(path=tmp_path / "other")
    c = make_chunks(6)
    for t in (watched, other):
        t.store(c.objs)
    assert observe.observed(watched) is None  # the default observer: nothing listens
    with observe.installed(ReadTraces()) as traces:
        trace = traces.watch(watched)
        assert observe.observed(watched) is traces and observe.observed(other) is None
        assert _payloads(other, c.keys) == c.payloads
        assert trace._events == []
        assert _payloads(watched, c.keys) == c.payloads
        recorded = list(trace._events)
        assert sum(d for _, kind, d in recorded if kind == "io" and d > 0) == 6
    assert _payloads(watched, c.keys) == c.payloads  # loaded with the observer gone
    assert trace._events == recorded


def test_a_hung_mount_times_the_load_out_and_everything_comes_back_once_it_answers(tmp_path):
    """faultfs in ``hang`` mode: the loop blocks in the kernel, the consumer
    gives up at its deadline, and once the mount answers again the loop
    drains, and its buffers and descriptors come back."""
    from kvtier.bench.faultfs import mounted

    (tmp_path / "src").mkdir()
    with mounted(tmp_path / "src", tmp_path / "mnt") as fs:
        pool = CountingPool()
        tier = SharedTier(shared_config(tmp_path / "mnt" / "shared", 256 * OBJ, o_direct=True), pool=pool)
        try:
            c = make_chunks(8)
            tier.store(c.objs)
            assert _payloads(tier, c.keys) == c.payloads
            before = _fds()
            fs.set(mode="hang")
            stream = tier._stream(c.keys)
            assert isinstance(stream, NativeStream)
            t0 = time.monotonic()
            assert list(stream.iter(0.5)) == []
            assert time.monotonic() - t0 < 0.5 + 0.5
            assert isinstance(stream.failed, TimeoutError) or type(stream.failed).__name__ == "TimeoutError"
            assert fs.hung() > 0
            fs.heal()
            assert _all_returned(pool, timeout=10)
            assert _no_fd_leak(before, timeout=10)
            assert _payloads(tier, c.keys) == c.payloads  # and the tier serves the next load
        finally:
            fs.heal()
            tier.close()


def test_a_store_folder_that_will_not_open_fails_the_load_at_once(open_tier, tmp_path):
    """The loop opens the store's folder on its own thread; where that
    fails, the load fails with the error (the tier counts it), without
    waiting for its deadline, and its buffers come back."""
    pool = CountingPool()
    tier = open_tier(pool=pool)
    c = make_chunks(6)
    tier.store(c.objs)
    root = tier.dir.root
    root.rename(tmp_path / "elsewhere")
    try:
        stream = tier._stream(c.keys)
        assert isinstance(stream, NativeStream)
        t0 = time.monotonic()
        assert list(stream.iter(5.0)) == []
        assert time.monotonic() - t0 < 2
        assert isinstance(stream.failed, FileNotFoundError)
        assert _all_returned(pool)
    finally:
        (tmp_path / "elsewhere").rename(root)
