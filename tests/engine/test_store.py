"""TieredStore over real memory, disk and shared tiers: prefix segments,
loads with promotion, write-through with a bounded backlog, drains on close,
and partial failures that never advertise chunks behind a gap."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from kvtier.config import ConfigError, parse_store_config
from kvtier.engine.store import Segment, TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.shared import SharedTier
from tests.support import (
    DTYPE,
    OBJ,
    assert_object,
    disk_config,
    hold_reads,
    make_chunks,
    payload_for,
    shared_config,
    spin_cpu,
)


@pytest.fixture
def open_store(tmp_path, metrics):
    opened = []

    def open_(tiers=("memory", "disk", "shared"), capacity=64 * OBJ, **opts):
        specs = []
        for kind in tiers:
            spec = {"kind": kind, "capacity": f"{capacity}B"}
            if kind != "memory":
                spec.update(path=str(tmp_path / kind), io_threads=4)
            if kind == "shared":
                spec["gc_interval_s"] = 0
                (tmp_path / kind).mkdir(exist_ok=True)  # a shared tier's folder must exist (a mount point)
            specs.append(spec)
        store = TieredStore(parse_store_config({"tiers": specs, "chunk_tokens": 16, **opts}), metrics)
        opened.append(store)
        return store

    yield open_
    for s in opened:
        s.close()


def _load(store, keys) -> list[bytes]:
    bufs = [bytearray(len(payload_for(k))) for k in keys]
    n = store.load(keys, bufs)
    return [bytes(b) for b in bufs[:n]]


def _layered(store, c):
    """memory holds chunks 0-2, disk 0-6, shared 0-9."""
    store.tier("memory").store(c.objs[:3])
    store.tier("disk").store(c.objs[:7])
    store.tier("shared").store(c.objs[:10])


# ---------------------------------------------------------------- lookup and load


def test_lookup_is_the_longest_prefix_over_all_tiers_in_segments(open_store):
    store = open_store()
    c = make_chunks(12)
    _layered(store, c)
    plan = store.lookup(c.keys)
    assert plan.chunks == 10
    assert plan.tokens == sum(k.num_tokens for k in c.keys[:10])
    assert plan.segments == (Segment("memory", 0, 3), Segment("disk", 3, 7), Segment("shared", 7, 10))
    assert plan.tokens_by_tier(c.keys) == {"memory": 48, "disk": 64, "shared": 48}


@pytest.mark.parametrize("short", [1, 5, 8])  # in memory's segment, disk's, shared's (read by AIO, copied where verified)
def test_load_ends_at_a_buffer_of_another_size_in_any_segment(open_store, short):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    bufs = [bytearray(len(payload_for(k))) for k in c.keys]
    bufs[short] = bytearray(len(bufs[short]) + 4096)
    assert store.load(c.keys, bufs) == short
    assert [bytes(b) for b in bufs[:short]] == c.payloads[:short]
    assert _load(store, c.keys) == c.payloads  # the store is none the worse
    two = [bytearray(len(p)) for p in c.payloads[:2]]
    assert store.load(c.keys[:4], two) == 2  # fewer buffers than keys: as many chunks as buffers
    assert [bytes(b) for b in two] == c.payloads[:2]


def test_a_load_into_lent_buffers_serves_every_segment_and_what_memory_took_stays_intact(open_store):
    """Chunks read in place into lent slots, copied into them from memory;
    promoted objects that live in a slot's buffer keep it: the next load
    into the same buffers writes elsewhere."""
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    lb = store.load_buffers(10, len(c.payloads[0]))
    assert store.load(c.keys, lb) == 10
    assert [bytes(lb.payload(i)) for i in range(10)] == c.payloads
    assert store.tier("memory").lookup(c.keys) == 10
    d = make_chunks(10, seed=2)
    store.tier("shared").store(d.objs)
    assert store.load(d.keys, lb) == 10
    assert [bytes(lb.payload(i)) for i in range(10)] == d.payloads
    assert store.lookup(c.keys).segments == (Segment("memory", 0, 10),)
    assert _load(store, c.keys) == c.payloads
    assert store.load(c.keys[:3], lb[7:]) == 3 and [bytes(lb.payload(i)) for i in range(7, 10)] == c.payloads[:3]


def test_lookup_stops_at_a_chunk_no_tier_holds(open_store):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    store.tier("shared").delete([c.keys[8]])
    assert store.lookup(c.keys).chunks == 8
    store.tier("disk").delete([c.keys[0]])  # memory still has it
    assert store.lookup(c.keys).chunks == 8
    assert store.lookup([]).chunks == 0


def test_load_reads_each_segment_from_its_tier_and_promotes_into_memory(open_store, metrics):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    assert _load(store, c.keys) == c.payloads
    hits = {t: metrics.value("kvtier_hit_chunks_total", tier=t) for t in ("memory", "disk", "shared")}
    assert hits == {"memory": 3, "disk": 4, "shared": 3}
    assert store.tier("memory").lookup(c.keys) == 10
    assert store.lookup(c.keys).segments == (Segment("memory", 0, 10),)
    assert _load(store, c.keys) == c.payloads  # now from memory, whole
    assert metrics.value("kvtier_hit_chunks_total", tier="memory") == 13


def test_a_load_given_no_plan_does_not_ask_the_last_tier_whose_read_stops_at_its_first_miss(
        open_store, metrics, monkeypatch):
    store = open_store()
    c = make_chunks(12)
    _layered(store, c)  # memory 0-2, disk 0-6, shared 0-9; no tier holds 10-11
    asked = []
    for name in ("memory", "disk", "shared"):
        tier = store.tier(name)
        monkeypatch.setattr(tier, "lookup", lambda keys, *a, _ask=tier.lookup, _name=name: asked.append(_name) or _ask(keys, *a))
    assert _load(store, c.keys) == c.payloads[:10]
    assert set(asked) == {"memory", "disk"}  # the shared tier's own read found where its chunks end
    hits = {t: metrics.value("kvtier_hit_chunks_total", tier=t) for t in ("memory", "disk", "shared")}
    assert hits == {"memory": 3, "disk": 4, "shared": 3}
    assert metrics.value("kvtier_miss_chunks_total", tier="shared") == 2
    # a lookup still asks every tier
    asked.clear()
    assert store.lookup(c.keys).chunks == 10 and "shared" in asked


def test_load_without_promotion_leaves_memory_as_it_was(open_store):
    store = open_store(promote=False)
    c = make_chunks(10)
    _layered(store, c)
    assert _load(store, c.keys) == c.payloads
    assert store.tier("memory").lookup(c.keys) == 3


def test_fetch_yields_verified_objects_in_order(open_store):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    n = 0
    for obj in store.fetch(c.keys):
        assert_object(obj, c.keys[n])
        n += 1
    assert n == 10


def test_a_segment_that_comes_up_short_ends_the_load(open_store):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    plan = store.lookup(c.keys)
    store.tier("disk").delete([c.keys[5]])  # gone between lookup and load
    bufs = [bytearray(len(p)) for p in c.payloads]
    assert store.load(c.keys, bufs, plan) == 5  # never chunks 7-9 behind the hole
    assert [bytes(b) for b in bufs[:5]] == c.payloads[:5]


def test_a_load_that_ends_before_a_segment_stops_that_segments_reads(open_store, monkeypatch):
    """Every segment's reads start with the load; one the load never
    reaches (an earlier tier came up short) is stopped when the load ends:
    its reads do not go on for nobody, and what it read is released."""
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    plan = store.lookup(c.keys)
    streams = []
    shared = store.tier("shared")
    real = shared._stream

    def recorded(keys, into=None):
        st = real(keys, into)
        stop = st.stop
        st.stopped_at = []
        st.stop = lambda consumed=0: (st.stopped_at.append(consumed), stop(consumed))[1]
        streams.append(st)
        return st

    monkeypatch.setattr(shared, "_stream", recorded)
    store.tier("disk").delete([c.keys[5]])  # gone between lookup and load
    bufs = [bytearray(len(p)) for p in c.payloads]
    assert store.load(c.keys, bufs, plan) == 5
    assert len(streams) == 1 and streams[0].stopped_at == [0]


def test_load_stops_at_a_wrong_size_buffer(open_store):
    store = open_store()
    c = make_chunks(10)
    _layered(store, c)
    bufs = [bytearray(len(p)) for p in c.payloads]
    bufs[4] = bytearray(1)
    assert store.load(c.keys, bufs) == 4


def test_prefetch_fills_the_memory_tier(open_store):
    store = open_store()
    c = make_chunks(6)
    store.tier("disk").store(c.objs)
    assert store.prefetch(c.keys).result(10) == 6
    assert store.tier("memory").lookup(c.keys) == 6


def test_prefetch_says_when_each_chunk_is_in_memory(open_store):
    """A loader takes chunk i as soon as the prefetch stored it, while later
    chunks are still being read."""
    store = open_store(tiers=("memory", "disk"))
    c = make_chunks(6)
    disk = store.tier("disk")
    disk.store(c.objs)
    gate = threading.Event()
    hold_reads(disk, c.keys, 3, gate)
    pf = store.prefetch(c.keys)
    assert pf.wait(3, timeout=10)
    assert store.tier("memory").lookup(c.keys[:3]) == 3
    assert not pf.wait(4, timeout=0.2)  # chunk 3 is held back: not there yet
    assert pf.stored_count() == 3
    gate.set()
    assert pf.wait(6, timeout=10)
    assert pf.result(10) == 6


def test_prefetch_that_stops_short_ends_every_wait(open_store):
    store = open_store(tiers=("memory", "disk"))
    c = make_chunks(6)
    store.tier("disk").store(c.objs[:2])  # chunks 2-5 are nowhere
    pf = store.prefetch(c.keys)
    t0 = time.monotonic()
    assert pf.wait(2, timeout=10)
    assert not pf.wait(3, timeout=10)
    assert time.monotonic() - t0 < 5  # answered when the prefetch ended, not at the timeout
    assert pf.result(10) == 2


# ---------------------------------------------------------------- save


def test_save_writes_through_to_every_tier(open_store):
    store = open_store()
    c = make_chunks(6)
    payloads = [bytearray(p) for p in c.payloads]
    assert store.save(c.keys, payloads, DTYPE, c.shapes) == 6
    for p in payloads:
        p[:] = bytes(len(p))  # the caller's buffers are free once save returns
    assert store.flush(10)
    for name in ("memory", "disk", "shared"):
        tier = store.tier(name)
        assert tier.lookup(c.keys) == 6, name
        n = 0
        for obj in tier.fetch(c.keys):
            assert_object(obj, c.keys[n])
            n += 1
        assert n == 6, name


def test_save_returns_while_writes_are_stuck_and_drops_what_the_queue_cannot_take(open_store, metrics, write_gate):
    store = open_store(save_queue_bytes=f"{2 * OBJ}B")
    c = make_chunks(4)
    t0 = time.monotonic()
    assert store.save(c.keys[:1], c.payloads[:1], DTYPE, c.shapes[:1]) == 1
    for _ in range(2):  # one write per persistent tier, both stuck
        assert write_gate.waiting.acquire(timeout=10)

    done = threading.Event()

    def save_more():
        store.save(c.keys[1:], c.payloads[1:], DTYPE, c.shapes[1:])
        done.set()

    t = threading.Thread(target=save_more)
    t.start()
    assert done.wait(5), "save() blocked on a full write-through queue"
    assert time.monotonic() - t0 < 5
    for name in ("disk", "shared"):
        assert metrics.value("kvtier_dropped_saves_total", tier=name, reason="queue_full") == 3
    assert store.tier("memory").lookup(c.keys) == 4

    write_gate.open()
    t.join()
    assert store.flush(10)
    for name in ("disk", "shared"):
        assert store.tier(name).lookup(c.keys) == 1
    # The backlog is free again: saves that fit are written through.
    for i in range(1, 4):
        store.save(c.keys[i : i + 1], c.payloads[i : i + 1], DTYPE, c.shapes[i : i + 1])
        assert store.flush(10)
    for name in ("disk", "shared"):
        assert store.tier(name).lookup(c.keys) == 4


def test_a_queue_smaller_than_one_object_drops_every_write_through(open_store, metrics):
    store = open_store(save_queue_bytes="1B")
    c = make_chunks(3)
    assert store.save(c.keys, c.payloads, DTYPE, c.shapes) == 3
    assert store.flush(10)
    assert store.tier("memory").lookup(c.keys) == 3
    for name in ("disk", "shared"):
        assert store.tier(name).lookup(c.keys) == 0
        assert metrics.value("kvtier_dropped_saves_total", tier=name, reason="queue_full") == 3


def test_after_flush_the_backlog_is_free(open_store, metrics):
    # flush() returns only once finished jobs have given their room back, so
    # a save right after it is never dropped for a full queue.
    store = open_store(tiers=("disk",), save_queue_bytes=f"{OBJ}B")
    c = make_chunks(40)
    for i in range(40):
        store.save(c.keys[i : i + 1], c.payloads[i : i + 1], DTYPE, c.shapes[i : i + 1])
        assert store.flush(10)
    assert metrics.value("kvtier_dropped_saves_total", tier="disk", reason="queue_full") == 0
    assert store.lookup(c.keys).chunks == 40


def test_close_drains_pending_write_through(open_store, tmp_path, write_gate):
    store = open_store()
    c = make_chunks(5)
    store.save(c.keys, c.payloads, DTYPE, c.shapes)
    assert write_gate.waiting.acquire(timeout=10)
    opener = threading.Timer(0.2, write_gate.open)
    opener.start()
    store.close()
    opener.join()
    with DiskTier(disk_config(tmp_path / "disk")) as disk:
        assert disk.lookup(c.keys) == 5
    with SharedTier(shared_config(tmp_path / "shared")) as shared:
        assert shared.lookup(c.keys) == 5
    assert [t.name for t in threading.enumerate() if t.name.startswith(("kvtier-disk-", "kvtier-shared-"))] == []


@pytest.mark.parametrize("kind", ["disk", "shared"])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_a_failed_chunk_in_a_batch_ends_the_advertised_prefix(open_store, metrics, monkeypatch, kind, k):
    store = open_store(tiers=(kind,))
    c = make_chunks(8)
    real = ObjectDir.write
    calls = []

    def write(self, obj, key, fsync):
        calls.append(key)
        if len(calls) == k + 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, obj, key, fsync)

    monkeypatch.setattr(ObjectDir, "write", write)
    assert store.save(c.keys, c.payloads, DTYPE, c.shapes) == 8
    assert store.flush(10)
    assert store.lookup(c.keys).chunks == k
    assert _load(store, c.keys) == c.payloads[:k]
    tier = store.tier(kind)
    assert (tier.stats().objects, tier.stats().used_bytes) == (k, k * OBJ)
    assert metrics.value("kvtier_dropped_saves_total", tier=kind, reason="no_space") == 8 - k
    assert len(calls) == k + 1  # nothing written behind the failure

    monkeypatch.setattr(ObjectDir, "write", real)
    store.save(c.keys, c.payloads, DTYPE, c.shapes)
    assert store.flush(10)
    assert store.lookup(c.keys).chunks == 8


def test_a_write_through_job_that_raises_is_counted_not_lost(open_store, metrics, monkeypatch):
    store = open_store(tiers=("memory", "disk"))
    c = make_chunks(2)

    def broken(self, obj, key, fsync):
        raise RuntimeError("bug in a backend")

    monkeypatch.setattr(ObjectDir, "write", broken)
    assert store.save(c.keys, c.payloads, DTYPE, c.shapes) == 2  # the caller never sees it
    assert store.flush(10)  # drained: the failure is accounted for, not raised
    assert metrics.value("kvtier_errors_total", tier="disk", op="store") == 1
    assert store.tier("disk").lookup(c.keys) == 0
    assert store.tier("memory").lookup(c.keys) == 2


# ---------------------------------------------------------------- construction


def test_a_failing_tier_closes_the_ones_already_opened(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = parse_store_config(
        {"tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB"},
                   {"kind": "shared", "path": str(blocker / "sub"), "capacity": "1MiB"}]}
    )
    with pytest.raises(ConfigError) as exc:
        TieredStore(cfg)
    assert "path" in exc.value.key and "Fix:" in str(exc.value)
    DiskTier(disk_config(tmp_path / "disk")).close()  # the disk directory was released


def test_stats_lists_every_tier_in_order(open_store):
    store = open_store()
    c = make_chunks(2)
    store.save(c.keys, c.payloads, DTYPE, c.shapes)
    store.flush(10)
    stats = store.stats()
    assert [(s.name, s.objects, s.used_bytes) for s in stats] == [
        ("memory", 2, 2 * OBJ), ("disk", 2, 2 * OBJ), ("shared", 2, 2 * OBJ)
    ]


def test_a_load_counts_its_tiers_threads_cpu_and_its_callers_but_not_its_consumers(open_store, metrics):
    """kvtier_io_cpu_seconds (a tier's threads, by job) and
    kvtier_load_caller_cpu_seconds (the thread asking, inside the load):
    together at most what the process spent, and the consumer's own work
    between objects is not the load's."""
    import resource

    def process_cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    store = open_store(tiers=("disk", "shared"))
    c = make_chunks(8)
    store.tier("shared").store(c.objs)
    store.tier("shared").drop_cache()

    def counted():
        return (metrics.value("kvtier_io_cpu_seconds_total", tier="shared", kind="load"),
                metrics.value("kvtier_load_caller_cpu_seconds_total"))

    io0, caller0 = counted()
    p0 = process_cpu()
    n = 0
    for obj in store.fetch(c.keys, promote=False):
        assert_object(obj, c.keys[n])
        n += 1
        spin_cpu(0.05)  # the consumer's work: 0.4 s in all
    p1 = process_cpu()
    io1, caller1 = counted()
    assert n == 8
    assert io1 > io0 and caller1 > caller0
    assert caller1 - caller0 < 0.2, "the consumer's CPU between objects was counted as the load's"
    assert (io1 - io0) + (caller1 - caller0) <= (p1 - p0) - 0.4 + 0.02  # clocks tick in steps: a little slack

    # A consumer that stops at the first object still counts what the load spent.
    it = store.fetch(c.keys, promote=False)
    next(it)
    it.close()
    assert metrics.value("kvtier_load_caller_cpu_seconds_total") > caller1

    # ``load`` (run through on the caller's thread) counts it once, and the
    # tier's threads theirs.
    caller2 = metrics.value("kvtier_load_caller_cpu_seconds_total")
    store.tier("shared").drop_cache()
    assert _load(store, c.keys) == c.payloads
    assert metrics.value("kvtier_load_caller_cpu_seconds_total") > caller2
    assert counted()[0] > io1
