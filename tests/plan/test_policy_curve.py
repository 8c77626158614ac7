"""Curves of tiers under an eviction policy other than LRU: a replay at each
capacity (``policy_curve``), which under LRU itself gives the one-pass
stack-distance curve."""

from __future__ import annotations

import pytest

from kvtier.plan.models import LRUModel
from kvtier.plan.stack import lru_curve, policy_curve
from kvtier.tiers.eviction.lfu import LFUPolicy
from kvtier.tiers.eviction.lru import LRUPolicy
from tests.plan.test_stack import _stream

CAPS = [16384, 40_000, 100_000, 333_333, 1 << 20, 4 << 20]


@pytest.mark.parametrize("seed", [1, 2])
def test_the_replay_under_lru_is_the_stack_distance_curve(seed):
    s = _stream(seed)
    total = sum(-v - 1 for v in s.vals if v < -1)
    assert policy_curve([s], CAPS, 1.0, total, LRUPolicy) == pytest.approx(lru_curve([s], CAPS, 1.0, total), abs=1e-12)


def test_the_lfu_curve_is_a_replay_through_the_model_under_lfu():
    s = _stream(1)
    total = sum(-v - 1 for v in s.vals if v < -1)
    got = policy_curve([s], CAPS, 1.0, total, LFUPolicy)
    for cap, y in zip(CAPS, got):
        m, held = LRUModel(cap, policy=LFUPolicy(cap)), 0
        for k, v in zip(s.keys, s.vals):
            if v >= 0:
                m.store(k, v)
            elif k in m:
                held += -v - 1
        assert y == held / total
    assert got[0] < got[-1]
    assert got != pytest.approx(lru_curve([s], CAPS, 1.0, total), abs=1e-6)  # another policy, another curve
