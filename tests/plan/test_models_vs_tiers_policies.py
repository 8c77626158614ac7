"""The simulator's tier models against the real tiers under eviction
policies other than each tier's default: the access sequence of
``test_models_vs_tiers`` through ``StoreModel`` (models made as the
simulator makes them, from ``TierPlan``) and through ``TieredStore`` with
the same ``eviction`` keys. After every step both must hold the same
objects in the same order, answer lookups alike and have evicted alike."""

from __future__ import annotations

import random
import time

import pytest

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.keys import chunk_keys
from kvtier.plan.cost import DEFAULT_IO
from kvtier.plan.models import LRUModel, SharedModel
from kvtier.plan.sim import TierPlan
from kvtier.plan.storemodel import StoreModel
from tests.plan.test_models_vs_tiers import DISK, HIGH, LOW, MEM, SHARED, STEPS, _ikey, _model_state, _state
from tests.support import BYTES_PER_TOKEN, NS, obj_for, tokens_for

POLICIES = [  # (memory, disk, shared)
    ("lfu", "lfu", "lru"),
    ("lfu", "lru", "watermark"),
    ("lru", "lfu", "lru"),
]


@pytest.fixture(params=POLICIES, ids="-".join)
def pair(request, tmp_path):
    mem_p, disk_p, shared_p = request.param
    (tmp_path / "shared").mkdir()
    specs = [
        {"kind": "memory", "capacity": f"{MEM}B", "eviction": mem_p},
        {"kind": "disk", "capacity": f"{DISK}B", "path": str(tmp_path / "disk"), "io_threads": 1, "eviction": disk_p},
        {"kind": "shared", "capacity": f"{SHARED}B", "path": str(tmp_path / "shared"), "io_threads": 1,
         "gc_interval_s": 0, "touch_interval_s": 0, "high_watermark": HIGH, "low_watermark": LOW,
         "eviction": shared_p},
    ]
    store = TieredStore(parse_store_config({"tiers": specs, "chunk_tokens": NS.chunk_tokens}))
    shared_dir = store.tier("shared").dir
    write = shared_dir.write

    def stamped_exactly(obj, key, fsync):  # see test_models_vs_tiers
        write(obj, key, fsync)
        shared_dir.touch(key, time.time())

    shared_dir.write = stamped_exactly
    clock = iter(range(1, 1 << 30))
    mem = TierPlan("memory", MEM, DEFAULT_IO["memory"], eviction=mem_p)
    disk = TierPlan("disk", DISK, DEFAULT_IO["disk"], eviction=disk_p)
    shared = TierPlan("shared", SHARED, DEFAULT_IO["shared"], HIGH, LOW, 0, 0, eviction=shared_p)
    model = StoreModel([("memory", LRUModel(MEM, policy=mem.policy())), ("disk", LRUModel(DISK, policy=disk.policy())),
                        ("shared", SharedModel(SHARED, HIGH, LOW, 0, 0, policy=shared.policy()))],
                       BYTES_PER_TOKEN, lambda: float(next(clock)))
    yield store, model
    store.close()


def test_one_access_sequence_gives_the_same_hits_and_evictions_under_each_policy(pair):
    store, model = pair
    rng = random.Random(11)
    names = [t.name for t in store.tiers]
    sessions = [tokens_for(s, 8 * NS.chunk_tokens + 5) for s in range(6)]
    for step in range(STEPS):
        s = min(int(rng.expovariate(0.35)), len(sessions) - 1)
        keys = chunk_keys(NS, sessions[s][:rng.randint(1, len(sessions[s]))])
        chunks = [(_ikey(k), k.num_tokens) for k in keys]
        plan = store.lookup(keys)
        real_holders = [names.index(seg.tier) for seg in plan.segments for _ in range(seg.start, seg.stop)]
        assert real_holders == model.lookup(chunks), f"step {step}: lookups differ"
        hit = plan.chunks
        if hit and rng.random() < 0.8:
            assert sum(1 for _ in store.fetch(keys[:hit])) == model.fetch(chunks[:hit])[0]
        start = 0 if rng.random() < 0.25 else hit
        objs = [obj_for(k) for k in keys[start:]]
        store.put(objs)
        for o in objs:
            o.release()
        assert store.flush(10)
        model.put(chunks[start:])
        if step % 5 == 4:
            assert store.tier("shared").gc().deleted == model.tiers[2][1].gc()
        assert _state(store) == _model_state(model), f"step {step}: tier contents differ"
    for name, (_, m) in zip(names, model.tiers):
        assert store.metrics.value("kvtier_evicted_chunks_total", tier=name) == m.evictions > 0, name
