"""Memory tier specifics: pinning of objects being read, refusal when only
pinned entries could make room, and the size checks the contract leaves out."""

from __future__ import annotations

import pytest

from kvtier.codec import encode
from kvtier.config import ConfigError, build
from kvtier.tiers.memory import MemoryConfig, MemoryTier
from tests.support import DTYPE, OBJ, assert_object, make_chunks, memory_config, payload_for


@pytest.fixture
def tier(metrics):
    t = MemoryTier(memory_config(3 * OBJ), metrics)
    yield t
    t.close()


def _present(tier, keys):
    return [i for i, k in enumerate(keys) if tier.lookup([k])]


def test_entries_being_read_are_not_evicted(tier):
    c = make_chunks(5)
    tier.store(c.objs[:3])
    reading = tier.fetch(c.keys[:1])
    held = next(reading)  # chunk 0 is lent and pinned
    tier.store(c.objs[1:3])  # already there: refreshes 1 and 2, so 0 is least recent
    tier.store([c.objs[3]])  # evicts the least recent unpinned entry: 1
    assert _present(tier, c.keys) == [0, 2, 3]
    assert_object(held, c.keys[0])
    reading.close()
    tier.store([c.objs[4]])  # unpinned again: 0 is now the least recent
    assert _present(tier, c.keys) == [2, 3, 4]


def test_a_store_that_needs_a_pinned_entry_is_refused_and_counted(tier, metrics):
    c = make_chunks(5)
    tier.store(c.objs[:3])
    reading = tier.fetch(c.keys[:3])
    held = next(reading)  # all three are pinned
    assert tier.store(c.objs[3:5]) == 0
    assert metrics.value("kvtier_dropped_saves_total", tier=tier.name, reason="capacity") == 2
    assert _present(tier, c.keys) == [0, 1, 2]
    assert tier.stats().used_bytes == 3 * OBJ
    assert_object(held, c.keys[0])
    for i, obj in enumerate(reading, start=1):
        assert_object(obj, c.keys[i])
    assert tier.store(c.objs[3:5]) == 2  # the read finished: room again
    assert _present(tier, c.keys) == [2, 3, 4]


def test_pins_are_counted_per_reader(tier):
    c = make_chunks(4)
    tier.store(c.objs[:3])
    r1, r2 = tier.fetch(c.keys[:1]), tier.fetch(c.keys[:1])
    next(r1), next(r2)
    r1.close()
    assert tier.store([c.objs[3]]) == 1  # 1 is evicted; 0 still pinned by r2
    assert _present(tier, c.keys) == [0, 2, 3]
    assert tier.delete(c.keys[:1]) == 0  # pinned: not deleted
    r2.close()
    assert tier.delete(c.keys[:1]) == 1


def test_an_object_larger_than_capacity_is_refused(metrics):
    tier = MemoryTier(memory_config(OBJ), metrics)
    key = make_chunks(1).keys[0]
    big = encode(key, DTYPE, (3, 2048), bytes(3 * 4096))  # 16 KiB object
    assert tier.store([big]) == 0
    assert tier.stats().objects == 0
    assert metrics.value("kvtier_dropped_saves_total", tier=tier.name, reason="capacity") == 1


def test_a_batch_stops_at_the_first_refused_object(metrics):
    tier = MemoryTier(memory_config(2 * OBJ), metrics)
    c = make_chunks(3)
    big = encode(c.keys[1], DTYPE, (4, 2048), bytes(4 * 4096))  # 20 KiB object
    assert tier.store([c.objs[0], big, c.objs[2]]) == 1
    assert _present(tier, c.keys) == [0]


def test_a_different_object_under_the_same_digest_replaces_the_old_one(tier):
    c = make_chunks(1)
    key = c.keys[0]
    tier.store(c.objs)
    other = key._replace(check=bytes(16))  # a naming collision: same digest, other chain
    obj = encode(other, DTYPE, (len(payload_for(key)) // 2,), payload_for(key))
    assert tier.store([obj]) == 1
    assert tier.lookup([key]) == 0  # never served for the original key
    assert tier.lookup([other]) == 1
    assert tier.stats().objects == 1 and tier.stats().used_bytes == OBJ


def test_a_digest_collision_is_a_miss_not_foreign_data(tier):
    c = make_chunks(1)
    tier.store(c.objs)
    impostor = c.keys[0]._replace(check=bytes(16))
    assert tier.lookup([impostor]) == 0
    assert list(tier.fetch([impostor])) == []


def test_capacity_is_required():
    with pytest.raises(ConfigError) as exc:
        build(MemoryConfig, {}, "tiers[0].")
    assert exc.value.key == "tiers[0].capacity" and "Fix:" in str(exc.value)
