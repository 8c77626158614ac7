"""The simulator's tier models against the real tiers under eviction
policies other than each tier's default: the access sequence of
``tests.plan.tierpair.replay`` through ``StoreModel`` (models made as the
simulator makes them, from ``TierPlan``) and through ``TieredStore`` with
the same ``eviction`` keys. After every step both must hold the same
objects in the same order, answer lookups alike and have evicted alike."""

from __future__ import annotations

import pytest

from kvtier.plan.cost import DEFAULT_IO
from kvtier.plan.models import LRUModel, SharedModel
from kvtier.plan.sim import TierPlan
from kvtier.plan.storemodel import StoreModel
from tests.plan.tierpair import DISK, HIGH, LOW, MEM, SHARED, replay, step_clock, three_tier_store
from tests.support import BYTES_PER_TOKEN, NS

POLICIES = [  # (memory, disk, shared)
    ("lfu", "lfu", "lru"),
    ("lfu", "lru", "watermark"),
    ("lru", "lfu", "lru"),
]


@pytest.fixture(params=POLICIES, ids="-".join)
def pair(request, tmp_path):
    mem_p, disk_p, shared_p = request.param
    store = three_tier_store(tmp_path, NS.chunk_tokens, eviction=request.param)
    mem = TierPlan("memory", MEM, DEFAULT_IO["memory"], eviction=mem_p)
    disk = TierPlan("disk", DISK, DEFAULT_IO["disk"], eviction=disk_p)
    shared = TierPlan("shared", SHARED, DEFAULT_IO["shared"], HIGH, LOW, 0, 0, eviction=shared_p)
    model = StoreModel([("memory", LRUModel(MEM, policy=mem.policy())), ("disk", LRUModel(DISK, policy=disk.policy())),
                        ("shared", SharedModel(SHARED, HIGH, LOW, 0, 0, policy=shared.policy()))],
                       BYTES_PER_TOKEN, step_clock())
    yield store, model
    store.close()


def test_one_access_sequence_gives_the_same_hits_and_evictions_under_each_policy(pair):
    store, model = pair
    replay(store, model, seed=11)
