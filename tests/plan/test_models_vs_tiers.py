"""The simulator's tier models against the real tiers: one access sequence
through ``StoreModel`` (LRU memory, LRU disk, shared watermark collector)
and through ``TieredStore`` over real ``MemoryTier``, ``DiskTier`` and
``SharedTier`` directories, with tiny chunks (``tests.plan.tierpair``).
After every step both must hold the same objects in the same recency order,
answer lookups alike and have evicted the same number of objects."""

from __future__ import annotations

import pytest

from kvtier.plan.models import LRUModel, SharedModel
from kvtier.plan.storemodel import StoreModel
from tests.plan.tierpair import DISK, HIGH, LOW, MEM, SHARED, replay, step_clock, three_tier_store
from tests.support import BYTES_PER_TOKEN, NS


@pytest.fixture
def pair(tmp_path):
    store = three_tier_store(tmp_path, NS.chunk_tokens)
    shared = SharedModel(SHARED, HIGH, LOW, touch_interval_s=0, gc_interval_s=0)
    model = StoreModel([("memory", LRUModel(MEM)), ("disk", LRUModel(DISK)), ("shared", shared)],
                       BYTES_PER_TOKEN, step_clock())
    yield store, model
    store.close()


def test_one_access_sequence_gives_the_same_hits_and_evictions(pair):
    store, model = pair
    served_real, served_model = replay(store, model, seed=7)
    assert served_real == served_model > 0
