"""Every built-in eviction policy through the one contract
(``PolicyContract``), and the order each keeps."""

from __future__ import annotations

import random

import pytest

from kvtier.tiers.eviction import rank
from kvtier.tiers.eviction.lfu import LFUPolicy
from kvtier.tiers.eviction.lru import LRUPolicy
from kvtier.tiers.eviction.watermark import WatermarkPolicy
from tests.tiers.eviction.policy_contract import PolicyContract


class TestLRU(PolicyContract):
    def make(self, capacity):
        return LRUPolicy(capacity)


class TestWatermarkAsTheCollectorRunsIt(PolicyContract):
    def make(self, capacity):
        return WatermarkPolicy(capacity, 0.95, 0.85)


class TestWatermarkAsShmRunsIt(PolicyContract):
    def make(self, capacity):
        return WatermarkPolicy(capacity, 1.0, 0.9)


class TestLFU(PolicyContract):
    def make(self, capacity):
        return LFUPolicy(capacity)


# ---------------------------------------------------------------- lru


def test_lru_goes_least_recently_used_first_and_a_use_sends_a_key_last():
    p = LRUPolicy(100)
    for k in "abcd":
        p.insert(k, 10)
    p.touch("a")
    p.insert("c", 10)  # a held key stored again: a use
    assert list(p) == ["b", "d", "a", "c"]
    assert p.victims(15) == ["b", "d"]


def test_lru_frees_just_enough():
    p = LRUPolicy(100)
    assert p.to_free(90, 10) == 0
    assert p.to_free(90, 25) == 15
    assert not p.over(100) and p.over(101)


# ---------------------------------------------------------------- watermark


def test_watermark_keeps_lru_order_and_frees_down_to_the_low_watermark():
    p = WatermarkPolicy(1000, 0.95, 0.85)
    assert p.to_free(950) == 0  # at the high watermark: nothing yet
    assert p.to_free(951) == 951 - 850
    assert p.over(951) and not p.over(950)
    # With a store coming: down to the low watermark, or lower if the store needs it.
    shm = WatermarkPolicy(1000, 1.0, 0.9)
    assert shm.to_free(950, 50) == 0
    assert shm.to_free(950, 51) == 950 - 900
    assert shm.to_free(950, 300) == 950 - 700


def _collector_rule(entries, high, low, capacity):
    """The collector's rule written directly: least recent first while usage is over the low watermark."""
    total = sum(s for _, s, _ in entries)
    out = []
    if total > high * capacity:
        after = total
        for e in sorted(entries, key=lambda e: e[2]):
            if after <= low * capacity:
                break
            out.append(e)
            after -= e[1]
    return out


def _shm_rule(entries, used, need, low, capacity):
    """Node memory's rule written directly: oldest stamps first until ``need`` fits, down to the low watermark."""
    if used + need <= capacity:
        return []
    target = min(capacity - need, int(low * capacity))
    out = []
    for e in sorted(entries, key=lambda e: e[2]):
        if used <= target:
            break
        out.append(e)
        used -= e[1]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_watermark_ranked_from_stamps_picks_what_each_rule_picks(seed):
    rng = random.Random(seed)
    capacity = rng.randrange(1000, 5000)
    # Stamps with ties: equal stamps go in scan order.
    entries = [(f"k{i}", rng.randrange(1, 200), float(rng.randrange(30))) for i in range(rng.randrange(0, 60))]
    size, stamp = (lambda e: e[1]), (lambda e: e[2])
    high, low = rng.choice([(0.95, 0.85), (0.9, 0.6), (1.0, 0.5)])
    p = rank(WatermarkPolicy(capacity, high, low), entries, size, stamp)
    assert p.victims(p.to_free(p.used)) == _collector_rule(entries, high, low, capacity)
    used, need = sum(map(size, entries)) + rng.randrange(0, 300), rng.randrange(0, 400)
    p = rank(WatermarkPolicy(capacity, 1.0, low), entries, size, stamp)
    assert p.victims(p.to_free(used, need)) == _shm_rule(entries, used, need, low, capacity)


# ---------------------------------------------------------------- lfu


def test_lfu_goes_least_frequently_used_first_and_among_equals_least_recently_used():
    p = LFUPolicy(100)
    for k in "abcd":
        p.insert(k, 10)  # one use each
    p.touch("a")
    p.touch("a")  # a: 3 uses
    p.touch("c")  # c: 2
    p.insert("b", 10)  # a held key stored again: b: 2, used after c
    assert list(p) == ["d", "c", "b", "a"]
    p.insert("e", 10)  # new: one use, the most recent of those
    assert list(p) == ["d", "e", "c", "b", "a"]
    assert p.victims(25) == ["d", "e", "c"]


def test_lfu_forgets_a_removed_keys_uses():
    p = LFUPolicy(100)
    p.insert("a", 10)
    for _ in range(5):
        p.touch("a")
    p.insert("b", 10)
    p.remove("a")
    p.insert("a", 10)  # back with one use, after b
    assert list(p) == ["b", "a"]


def test_lfu_frees_just_enough_and_cannot_be_rebuilt_from_stamps():
    p = LFUPolicy(100)
    assert p.to_free(90, 25) == 15
    with pytest.raises(TypeError):
        rank(p, [("a", 1, 0.0)], lambda e: e[1], lambda e: e[2])
