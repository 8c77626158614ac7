"""KV events, without an engine: the store's listener (real tiers), the
worker's naming of what it heard, and the scheduler's events from vLLM's
own ``Request`` and block hasher. End to end: test_events.py."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.events import (
    REMOVED, STORED, BlockEvents, Journals, Place, RankEvents, chunk_blocks, place_of)
from kvtier.integrations.vllm.metadata import KVTierWorkerMeta
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.keys import shard_key
from tests.support import OBJ, keys_for, objs_for

BS = 16


class Heard:
    def __init__(self):
        self.log: list[tuple[str, str, bytes]] = []

    def stored(self, tier, digests):
        self.log += [(STORED, tier, d) for d in digests]

    def removed(self, tier, digests):
        self.log += [(REMOVED, tier, d) for d in digests]


def test_the_store_tells_what_enters_and_leaves_each_tier(tmp_path):
    keys = keys_for(3, 3)
    objs = objs_for(keys)
    cfg = parse_store_config({"tiers": [
        {"kind": "memory", "capacity": f"{int(2.5 * objs[0].nbytes)}B"},
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64MiB"},
        {"kind": "shared", "path": str(tmp_path / "s"), "capacity": "64MiB"}]})
    (tmp_path / "s").mkdir()
    heard = Heard()
    with TieredStore(cfg) as store:
        store.listen(heard)
        store.put(objs[:2])
        assert heard.log[:2] == [(STORED, "memory", k.digest) for k in keys[:2]]
        store.flush()
        assert {(e[1], e[2]) for e in heard.log if e[0] == STORED} == {
            (t, k.digest) for t in ("memory", "disk", "shared") for k in keys[:2]}
        heard.log.clear()
        store.put(objs[2:])  # memory holds two: the oldest goes
        store.flush()
        assert (REMOVED, "memory", keys[0].digest) in heard.log
        heard.log.clear()
        for tier in ("disk", "shared"):
            store.tier(tier).delete([keys[1]])
        assert heard.log == [(REMOVED, "disk", keys[1].digest), (REMOVED, "shared", keys[1].digest)]
        for o in objs:
            o.release()


def test_a_store_nobody_listens_to_tells_nothing(tmp_path):
    cfg = parse_store_config({"tiers": [{"kind": "memory", "capacity": "1MiB"}]})
    with TieredStore(cfg) as store:
        assert all(t.on_removed is None for t in store.tiers)


def test_a_worker_names_what_it_heard_by_the_groups_keys_and_bounds_its_backlog():
    m = connector_metrics()
    ev = RankEvents(m, remembered=2, pending_limit=2)
    g = keys_for(3, 3)
    shards = [shard_key(k, 1, 2) for k in g]
    for k, s in zip(g, shards):
        ev.name(k, [s])  # the first is forgotten: two remembered
    ev.stored("memory", [s.digest for s in shards])
    assert ev.take() == [(STORED, "memory", g[1].digest), (STORED, "memory", g[2].digest)]
    before = m.events_dropped.labels("worker_backlog")._value.get()
    ev.removed("disk", [shards[1].digest, shards[2].digest, shards[2].digest])
    assert len(ev.take()) == 2
    assert m.events_dropped.labels("worker_backlog")._value.get() == before + 1
    assert ev.take() == []


def test_a_rank_that_evicts_another_ranks_shard_from_node_memory_says_the_chunk_left(node_dir):
    # Two ranks of TP=2, one node memory tier: each store evicts the oldest
    # objects of the node, whichever rank wrote them. Rank 1's write pushes
    # out rank 0's shard of chunk A: rank 0 never hears it, rank 1 must.
    a, b = keys_for(5, 2)
    sa = [shard_key(a, r, 2) for r in (0, 1)]
    sb = shard_key(b, 1, 2)
    size = objs_for([sa[0]])[0].nbytes
    cfg = parse_store_config({"tiers": [{"kind": "shm", "path": node_dir, "capacity": f"{2 * size + size // 2}B",
                                         "eviction": "lru"}]})
    m = connector_metrics()
    ranks = [RankEvents(m), RankEvents(m)]
    with TieredStore(cfg) as s0, TieredStore(cfg) as s1:
        for store, ev in zip((s0, s1), ranks):
            store.listen(ev)
            ev.name(a, sa)
        ranks[1].name(b, [shard_key(b, r, 2) for r in (0, 1)])
        s0.put(objs_for([sa[0]]))
        time.sleep(0.02)  # the stamps rank the objects
        s1.put(objs_for([sa[1]]))
        time.sleep(0.02)
        s1.put(objs_for([sb]))  # the node holds two: rank 0's shard of A goes
        assert not s0.tiers[0].lookup([sa[0]])
        assert ranks[0].take() == [(STORED, "shm", a.digest)]
        assert ranks[1].take() == [(STORED, "shm", a.digest), (REMOVED, "shm", a.digest),
                                   (STORED, "shm", b.digest)]


def test_ranks_reports_merge_in_the_worker_metadata():
    a = KVTierWorkerMeta(step=3, events=[(STORED, "memory", b"x")])
    b = KVTierWorkerMeta(step=3, events=[(STORED, "memory", b"x"), (REMOVED, "disk", b"y")])
    assert a.aggregate(b).events == [(STORED, "memory", b"x"), (STORED, "memory", b"x"), (REMOVED, "disk", b"y")]


def _request(tokens, salt=None):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BS, fn))


def _external(req) -> list:
    """The request's block hashes as vLLM's events carry them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def test_a_chunks_blocks_are_vllms_own_hashes_tokens_and_salt():
    req = _request(list(range(100, 164)), salt="alice")
    first = chunk_blocks(req, 0, 32, BS)
    assert first.hashes == tuple(_external(req)[:2]) and first.parent is None
    assert first.tokens == tuple(range(100, 132))
    assert first.extra_keys == [("alice",), None]  # vLLM salts the prompt's first block only
    second = chunk_blocks(req, 32, 32, BS)
    assert second.parent == _external(req)[1] and second.extra_keys == [None, None]
    assert chunk_blocks(req, 48, 32, BS) is None  # past the blocks vLLM hashed


def test_a_chunk_is_published_stored_once_every_rank_holds_it_and_removed_when_one_drops_it():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    m = connector_metrics()
    places = {"memory": Place("CPU", "LOCAL"), "shared": Place("STORAGE", "REMOTE")}
    ev = BlockEvents(2, places, BS, m)
    req = _request(list(range(200, 264)))
    key = keys_for(1, 1)[0]._replace(num_tokens=32)
    ev.remember(key, req, 0)
    ev.heard([(STORED, "shared", key.digest)])
    assert ev.take() == []  # one rank of two
    ev.heard([(STORED, "shared", key.digest), (STORED, "shared", key.digest)])
    (stored,) = ev.take()
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.medium, stored.locality, stored.ownership, stored.block_size) == (
        _external(req)[:2], "STORAGE", "REMOTE", "shared", BS)
    assert stored.token_ids == list(range(200, 232))
    ev.heard([(REMOVED, "shared", key.digest), (REMOVED, "shared", key.digest), (REMOVED, "memory", key.digest)])
    (removed,) = ev.take()  # once, and nothing for a tier it was never published in
    assert isinstance(removed, BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.ownership) == (_external(req)[:2], "STORAGE", "shared")
    ev.heard([(STORED, "memory", b"\0" * 32)])  # a chunk this scheduler never saw
    assert ev.take() == []


def test_without_vllms_block_hashes_nothing_is_published_and_that_is_counted():
    m = connector_metrics()
    ev = BlockEvents(1, {"memory": Place("CPU", "LOCAL")}, BS, m)
    req = _request(list(range(64)))
    req.block_hashes.clear()  # as with prefix caching off
    before = m.events_dropped.labels("no_block_hashes")._value.get()
    key = keys_for(1, 1)[0]._replace(num_tokens=32)
    ev.remember(key, req, 0)
    ev.heard([(STORED, "memory", key.digest)])
    assert ev.take() == []
    assert m.events_dropped.labels("no_block_hashes")._value.get() == before + 1


@pytest.mark.parametrize("kind,medium,locality", [
    ("memory", "CPU", "LOCAL"), ("disk", "STORAGE", "LOCAL"), ("shared", "STORAGE", "REMOTE")])
def test_tiers_places(tmp_path, kind, medium, locality):
    spec = {"kind": kind, "capacity": "1MiB"}
    if kind != "memory":
        spec["path"] = str(tmp_path / kind)
        (tmp_path / kind).mkdir()
    with TieredStore(parse_store_config({"tiers": [spec]})) as store:
        assert place_of(store.tiers[0]) == Place(medium, locality)


class _Pool(ThreadPoolExecutor):
    """A pool that takes the tier executor's priority argument (``Journals``)."""

    def submit(self, _priority, fn, *args):
        return super().submit(fn, *args)


def _retracted(ev: BlockEvents, journals: Journals, timeout: float = 10.0) -> None:
    """Poll ``journals`` into ``ev`` until nothing published stays held."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for tier, digests in journals.poll():
            ev.journaled(tier, digests)
        if ev._held == set():
            return
        time.sleep(0.01)


def test_a_shard_in_another_nodes_journal_takes_back_the_chunk_it_belongs_to(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved

    m = connector_metrics()
    ev = BlockEvents(2, {"shared": Place("STORAGE", "REMOTE")}, BS, m,
                     shards=lambda key: [shard_key(key, r, 2).digest for r in range(2)])
    req = _request(list(range(300, 364)))
    key = keys_for(2, 1)[0]._replace(num_tokens=32)
    ev.remember(key, req, 0)
    ev.heard([(STORED, "shared", key.digest)] * 2)
    assert len(ev.take()) == 1
    (tmp_path / "s").mkdir()
    cfg = parse_store_config({"tiers": [{"kind": "shared", "path": str(tmp_path / "s"), "capacity": "1MiB"}]})
    with TieredStore(cfg) as store, _Pool(1) as pool:
        journals = Journals(store.tiers, pool, interval_s=0)
        store.tiers[0].journal.append([shard_key(key, 1, 2).digest, b"\1" * 32])  # rank 1's shard, and another's
        _retracted(ev, journals)
    (removed,) = ev.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == _external(req)[:2]


def test_another_nodes_collection_on_s3_takes_back_what_this_engine_published_there():
    from vllm.distributed.kv_events import BlockRemoved

    from kvtier.tiers.s3.tier import S3Tier
    from tests.tiers.s3server import s3_config, shared_server

    srv = shared_server()
    prefix = f"events/{os.getpid()}-{time.monotonic_ns()}"
    keys = keys_for(4, 2)
    mine = S3Tier(s3_config(srv, prefix, OBJ, name="s3"))  # this engine's
    other = S3Tier(s3_config(srv, prefix, OBJ, name="s3-elsewhere"))  # another node's collector
    try:
        m = connector_metrics()
        ev = BlockEvents(1, {"s3": place_of(mine)}, BS, m)
        req = _request(list(range(400, 464)))
        key = keys[0]._replace(num_tokens=32)  # the request's first 32 tokens: 2 blocks
        ev.remember(key, req, 0)
        objs = objs_for(keys)
        assert mine.store(objs) == 2
        for o in objs:
            o.release()
        ev.heard([(STORED, "s3", key.digest)])
        (stored,) = ev.take()
        assert stored.medium == "STORAGE" and ev._held == {("s3", key.digest)}
        with _Pool(1) as pool:
            journals = Journals([mine], pool, interval_s=0)
            _retracted(ev, journals, timeout=1.0)
            assert ev.take() == []  # nothing deleted yet
            assert other.gc().deleted == 2  # over capacity: both go
            _retracted(ev, journals)
        (removed,) = ev.take()
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == _external(req)[:2]
    finally:
        mine.close()
        other.close()
