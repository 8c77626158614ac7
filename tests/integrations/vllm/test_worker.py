"""The connector's worker side, run without an engine: real TieredStore (memory
in front of a disk tier), CPU tensors shaped like vLLM's CPU KV cache, and
the load protocol vLLM drives (start_load_kv, then get_finished every step).
Engine behaviour itself is tested end to end in test_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.codec import encode
from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.metadata import ChunkIO, KVTierMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.topology import Topology
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.keys import shard_key
from kvtier.tiers.dir.files import ObjectDir
from tests.support import NS, hold_reads, keys_for

BS = NS.chunk_tokens  # one engine block per chunk
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NS.num_layers)]
NUM_BLOCKS = 8


def _worker(cfg, topology: Topology, heads: int = NS.num_kv_heads, load_threads: int = 1) -> tuple[KVTierWorker, dict]:
    """A worker of ``topology`` whose rank holds ``heads`` KV heads."""
    settings = Settings(cfg, NS, BS, NS.num_layers, "float16", topology, load_threads=load_threads)
    store = TieredStore(settings.topology.shard_config(cfg, topology.own_shard))
    worker = KVTierWorker(settings, store, LAYERS, NUM_BLOCKS, connector_metrics())
    # vLLM's CPU attention layout: [blocks, kv heads, block size, 2 * head dim].
    caches = {n: torch.zeros(NUM_BLOCKS, heads, BS, 2 * NS.head_dim, dtype=torch.float16) for n in LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches


@pytest.fixture
def rig(tmp_path, request):
    cfg = parse_store_config({"chunk_tokens": BS, "load_timeout_s": 60, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB", "io_threads": 4}]})
    worker, caches = _worker(cfg, Topology(1, 0), load_threads=getattr(request, "param", 1))
    yield worker.store, worker, caches
    worker.close()


def _payload(i: int, shape) -> torch.Tensor:
    return torch.full(shape, float(i + 1), dtype=torch.float16)


def _block_holds(caches, block: int, value: float) -> bool:
    return all(bool((t[block] == value).all()) for t in caches.values())


def _finish(worker, rid: str | set[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    done: set[str] = set()
    while not ({rid} if isinstance(rid, str) else rid) <= done:
        assert time.monotonic() < deadline, "the load never finished"
        _, finished = worker.get_finished(set(), idle=True)
        done |= finished or set()


def test_chunks_are_copied_in_while_later_ones_are_still_read(rig):
    """An asynchronous load hands each chunk over as it is read: the engine
    thread copies the first ones in while later reads are held back."""
    store, worker, caches = rig
    keys = keys_for(5, 6)
    shape = worker.layout.chunk_shape(1)
    objs = [encode(k, "float16", shape, _payload(i, shape).numpy().tobytes()) for i, k in enumerate(keys)]
    disk = store.tier("disk")
    disk.store(objs)
    gate = threading.Event()
    hold_reads(disk, keys, 3, gate)
    job = LoadJob("r1", [ChunkIO(k, [i + 1]) for i, k in enumerate(keys)], ["disk"] * len(keys))
    worker.start_load_kv(KVTierMetadata(loads=[job]))

    deadline = time.monotonic() + 5
    while not all(_block_holds(caches, i + 1, i + 1) for i in range(3)):
        assert time.monotonic() < deadline, "the first chunks were not copied in while the rest was held back"
        _, finished = worker.get_finished(set(), idle=True)
        assert not finished  # chunks 3-5 are not read yet
    assert not _block_holds(caches, 4, 4)
    gate.set()
    _finish(worker, "r1", 15)
    assert all(_block_holds(caches, i + 1, i + 1) for i in range(6))
    assert worker.get_block_ids_with_load_errors() == set()


def _stored_job(store, worker, rid: str, seed: int, n: int, first_block: int = 1, **kw) -> tuple[LoadJob, list]:
    """``n`` one-block chunks on the disk tier, chunk i holding i + 1, and
    a job loading them into blocks ``first_block``.. (``kw``: LoadJob's)."""
    keys = keys_for(seed, n)
    shape = worker.layout.chunk_shape(1)
    store.tier("disk").store([encode(k, "float16", shape, _payload(i, shape).numpy().tobytes())
                              for i, k in enumerate(keys)])
    return LoadJob(rid, [ChunkIO(k, [first_block + i]) for i, k in enumerate(keys)], ["disk"] * n, **kw), keys


def test_a_load_promotes_every_chunk_it_read_into_memory_the_last_too(rig):
    """What a load reads from disk goes into the memory tier once it is
    handed over, the last chunk included: the next resume reads memory."""
    store, worker, caches = rig
    job, keys = _stored_job(store, worker, "r", 10, 3)
    assert store.memory.lookup(keys) == 0
    worker.start_load_kv(KVTierMetadata(loads=[job]))
    _finish(worker, "r")
    assert all(_block_holds(caches, i + 1, i + 1) for i in range(3))
    assert store.memory.lookup(keys) == 3


def test_the_stores_hand_off_promotes_only_what_was_taken_and_said(rig):
    """``TieredStore.fetching``, as the reader uses it: each object taken is
    the taker's own reference; the memory tier takes what was taken only at
    ``promote``; what was taken after it, or never, stays out."""
    store, worker, _ = rig
    _, keys = _stored_job(store, worker, "unused", 16, 3)
    with store.fetching(keys) as fetch:
        first = fetch.take()
        assert store.memory.lookup(keys) == 0  # not before the taker says so
        fetch.promote()
        assert store.memory.lookup(keys) == 1
        second = fetch.take()
    assert store.memory.lookup(keys) == 1  # taken, never promoted: closed without it
    for obj in (first, second):
        assert obj.header.num_tokens == BS  # still the taker's to read
        obj.release()
    with store.fetching(keys_for(99, 1)) as fetch:
        assert fetch.take() is None  # not stored: the fetch stops there


def test_a_load_stops_at_its_budget_keeping_the_chunks_that_arrived(rig):
    """Chunks 0-1 arrive, the rest hangs: at its budget the load is reported
    done, chunks 0-1 in, blocks 3-6 failed (vLLM recomputes them), long
    before the held reads end; the stop is reported to the scheduler."""
    store, worker, caches = rig
    job, keys = _stored_job(store, worker, "r", 11, 6, budget_s=0.3)
    gate = threading.Event()
    hold_reads(store.tier("disk"), keys, 2, gate)
    try:
        t0 = time.monotonic()
        worker.start_load_kv(KVTierMetadata(loads=[job]))
        _finish(worker, "r", timeout=5)
        assert 0.3 <= time.monotonic() - t0 < 3
        assert _block_holds(caches, 1, 1) and _block_holds(caches, 2, 2)
        assert worker.get_block_ids_with_load_errors() == {3, 4, 5, 6}
        meta = worker.worker_meta(12)
        assert meta.stopped == {"r": "budget"} and meta.step == 12
        seconds, tokens = meta.reads["r"]
        assert tokens == 2 * BS and 0.3 <= seconds < 3
        # Every later step reports its number, loads or none: vLLM would
        # otherwise drop an empty step's output and the scheduler could
        # not time the steps (costs.py).
        quiet = worker.worker_meta(13)
        assert quiet.step == 13 and not quiet.reads and not quiet.stopped
    finally:
        gate.set()
    assert not _block_holds(caches, 3, 3)  # what lands after the stop is dropped, never copied in


def test_a_load_stops_when_what_arrived_shows_the_rest_reads_slower_than_prefill(rig):
    """An engine that computes a token in a nanosecond: after two chunks
    the rest is projected to read slower than it recomputes, so the load
    stops there. At a second per token it reads everything."""
    store, worker, caches = rig
    job, _ = _stored_job(store, worker, "fast-engine", 12, 4, budget_s=60.0, prefill_s_per_token=1e-9)
    worker.start_load_kv(KVTierMetadata(loads=[job]))
    _finish(worker, "fast-engine")
    assert _block_holds(caches, 1, 1) and _block_holds(caches, 2, 2)
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.worker_meta().stopped == {"fast-engine": "projected"}

    job, _ = _stored_job(store, worker, "slow-engine", 13, 3, first_block=5, budget_s=60.0, prefill_s_per_token=1.0)
    worker.start_load_kv(KVTierMetadata(loads=[job]))
    _finish(worker, "slow-engine")
    assert all(_block_holds(caches, 5 + i, i + 1) for i in range(3))
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.worker_meta().stopped == {}


@pytest.mark.parametrize("rig", [2], indirect=True)  # load_threads 2: two loads read at once
def test_loads_reading_at_once_are_each_charged_their_share_of_the_time(rig):
    """Two loads read side by side for about half a second: each reports
    about half of it (the tier's one-load-alone time, costs.py), not all."""
    store, worker, caches = rig
    a, ka = _stored_job(store, worker, "a", 14, 1, first_block=1)
    b, kb = _stored_job(store, worker, "b", 15, 1, first_block=2)
    gate = threading.Event()
    hold_reads(store.tier("disk"), ka + kb, 0, gate)
    t0 = time.monotonic()
    worker.start_load_kv(KVTierMetadata(loads=[a, b]))
    threading.Timer(0.5, gate.set).start()
    _finish(worker, {"a", "b"})
    wall = time.monotonic() - t0
    reads = worker.worker_meta().reads
    assert reads["a"][1] == reads["b"][1] == BS
    assert reads["a"][0] + reads["b"][0] <= wall + 0.01
    assert 0.15 < reads["a"][0] < 0.5 * wall + 0.1 and 0.15 < reads["b"][0] < 0.5 * wall + 0.1


def test_each_rank_saves_and_loads_only_its_own_shard(tmp_path):
    """Two TP ranks save the same chunk of the group's chain: two objects
    under two names. Each rank loads back its own shard; with rank 1's shard
    gone, rank 1 reports the chunk's block as failed (vLLM recomputes it for
    every rank) and does not take rank 0's shard instead."""
    (tmp_path / "shared").mkdir()  # a shared tier's folder must exist (a mount point)
    cfg = parse_store_config({"chunk_tokens": BS, "tiers": [
        {"kind": "shared", "path": str(tmp_path / "shared"), "capacity": "1MiB", "io_threads": 2}]})
    ranks = [_worker(cfg, Topology(2, r)) for r in (0, 1)]
    try:
        key = keys_for(7, 1)[0]
        for r, (worker, caches) in enumerate(ranks):
            for t in caches.values():
                t[1].fill_(float(10 + r))
            worker.wait_for_save(KVTierMetadata(saves=[SaveJob("s", [ChunkIO(key, [1])])]))
            assert worker.store.flush(10)
        odir = ObjectDir(tmp_path / "shared", "test")
        names = {e.key_hex for e in odir.scan()}
        assert names == {shard_key(key, 0, 2).hex, shard_key(key, 1, 2).hex}
        assert key.hex not in names

        for r, (worker, caches) in enumerate(ranks):
            for t in caches.values():
                t[2].zero_()
            worker.start_load_kv(KVTierMetadata(loads=[LoadJob("l", [ChunkIO(key, [2])], ["shared"])]))
            _finish(worker, "l")
            assert _block_holds(caches, 2, float(10 + r)), f"rank {r} loaded another rank's shard"
            assert worker.get_block_ids_with_load_errors() == set()

        odir.unlink(shard_key(key, 1, 2))
        worker, caches = ranks[1]
        worker.start_load_kv(KVTierMetadata(loads=[LoadJob("m", [ChunkIO(key, [3])], ["shared"])]))
        _finish(worker, "m")
        assert worker.get_block_ids_with_load_errors() == {3}
        assert not _block_holds(caches, 3, 10.0)
    finally:
        for worker, _ in ranks:
            worker.close()


def test_a_shard_is_assembled_from_shards_another_tp_size_wrote(tmp_path):
    """Written at TP=2 (two heads per rank), read at TP=1 (four heads): the
    TP=1 worker concatenates the two shards' heads; written at TP=1, read at
    TP=2: rank 1 cuts its two heads out. Each assembled shard is stored under
    the reader's own key, so the next load reads it directly."""
    (tmp_path / "shared").mkdir()  # a shared tier's folder must exist (a mount point)
    cfg = parse_store_config({"chunk_tokens": BS, "tiers": [
        {"kind": "shared", "path": str(tmp_path / "shared"), "capacity": "4MiB", "io_threads": 2}]})
    key = keys_for(9, 1)[0]
    writers = [_worker(cfg, Topology(2, r, heads=4, other_tp_sizes=(1,)), heads=2) for r in (0, 1)]
    reader, rcaches = _worker(cfg, Topology(1, 0, heads=4, other_tp_sizes=(2,)), heads=4)
    try:
        for r, (w, caches) in enumerate(writers):
            for t in caches.values():
                for h in range(2):
                    t[1, h].fill_(float(10 * r + h))  # rank r's head h is model head 2r + h
            w.wait_for_save(KVTierMetadata(saves=[SaveJob("s", [ChunkIO(key, [1])])]))
            assert w.store.flush(10)
        reader.start_load_kv(KVTierMetadata(loads=[LoadJob("l", [ChunkIO(key, [2], source_tp=2)], ["shared"])]))
        _finish(reader, "l")
        assert reader.get_block_ids_with_load_errors() == set()
        for t in rcaches.values():
            assert [float(t[2, h, 0, 0]) for h in range(4)] == [0.0, 1.0, 10.0, 11.0]
        assert reader.store.flush(10)
        assert reader.store.lookup([key]).chunks == 1  # stored as a TP=1 chunk now

        # The other way: the TP=1 object, read by TP=2 rank 1.
        for t in rcaches.values():
            for h in range(4):
                t[3, h].fill_(float(100 + h))
        key2 = keys_for(10, 1)[0]
        reader.wait_for_save(KVTierMetadata(saves=[SaveJob("s2", [ChunkIO(key2, [3])])]))
        assert reader.store.flush(10)
        w1, caches1 = writers[1]
        w1.start_load_kv(KVTierMetadata(loads=[LoadJob("m", [ChunkIO(key2, [4], source_tp=1)], ["shared"])]))
        _finish(w1, "m")
        assert w1.get_block_ids_with_load_errors() == set()
        for t in caches1.values():
            assert [float(t[4, h, 0, 0]) for h in range(2)] == [102.0, 103.0]
    finally:
        for w, _ in writers + [(reader, rcaches)]:
            w.close()


def test_paced_loads_are_handed_to_the_engine_one_per_step_in_the_order_they_started(rig):
    """With ``release`` 1 each step reports one finished load, the oldest
    first: a younger load that finished waits behind an older one still
    reading (every rank then reports the same request in the same order)."""
    store, worker, caches = rig
    a, ka = _stored_job(store, worker, "a", 21, 1, first_block=1)
    b, kb = _stored_job(store, worker, "b", 22, 1, first_block=2)
    c, kc = _stored_job(store, worker, "c", 23, 1, first_block=3)
    gate = threading.Event()
    hold_reads(store.tier("disk"), ka + kb + kc, 0, gate)  # a's read held; b and c finish once the gate opens
    worker.start_load_kv(KVTierMetadata(loads=[a, b, c]))
    gate.set()
    order: list[set[str]] = []
    deadline = time.monotonic() + 10
    while sum(len(s) for s in order) < 3:
        assert time.monotonic() < deadline, order
        _, finished = worker.get_finished(set(), idle=True, release=1)
        if finished:
            order.append(finished)
    assert order == [{"a"}, {"b"}, {"c"}]
    assert all(_block_holds(caches, block, 1) for block in (1, 2, 3))  # each job's one chunk holds 1
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_younger_load_that_finished_waits_for_the_oldest_when_paced(rig):
    """b is read while a's read is held: paced, neither is handed over
    until a is in; unpaced, b would go first."""
    store, worker, caches = rig
    a, ka = _stored_job(store, worker, "a", 24, 1, first_block=1)
    b, kb = _stored_job(store, worker, "b", 25, 1, first_block=2)
    gate = threading.Event()
    hold_reads(store.tier("disk"), kb + ka, 1, gate)  # a's read held, b's not
    worker.start_load_kv(KVTierMetadata(loads=[a, b]))
    time.sleep(0.3)
    for _ in range(5):
        _, finished = worker.get_finished(set(), idle=True, release=1)
        assert not finished  # b may be read, but a is not: nothing is handed over
    gate.set()
    _finish(worker, {"a", "b"})
