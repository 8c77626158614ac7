"""One-pass stack-distance curves against brute-force replays."""

from __future__ import annotations

import random

import pytest

from kvtier.plan.models import SharedModel
from kvtier.plan.stack import (
    StreamRecorder,
    _Stream,
    lookup_distances,
    lru_curve,
    lru_replay,
    shared_curve,
)


def _stream(seed: int, n: int = 3000, keys: int = 300) -> _Stream:
    """Uses and lookups of keys with a skewed popularity and a few sizes
    (full and partial chunks)."""
    rng = random.Random(seed)
    size = {k: rng.choice((8192, 8192, 8192, 4096 + 4096 * rng.randint(1, 3))) for k in range(keys)}
    s = _Stream()
    for _ in range(n):
        k = min(int(rng.paretovariate(0.6)) - 1, keys - 1)
        if rng.random() < 0.4:
            s.keys.append(k)
            s.vals.append(-rng.randint(1, 256) - 1)  # a lookup of some tokens
        else:
            s.keys.append(k)
            s.vals.append(size[k])
        s.times.append(0.0)
    return s


@pytest.mark.parametrize("seed", [1, 2])
def test_lru_curve_equals_brute_force_at_every_capacity(seed):
    s = _stream(seed)
    total = sum(-v - 1 for v in s.vals if v < -1)
    caps = [16384, 40_000, 100_000, 333_333, 1 << 20, 4 << 20]  # none below the largest object
    curve = lru_curve([s], caps, 1.0, total)
    brute = [lru_replay(s.keys, s.vals, c) / total for c in caps]
    assert curve == pytest.approx(brute, abs=1e-12)
    assert curve[0] < curve[-1]  # the curve moves over the range tested


def test_distances_by_hand():
    # a(10) b(20) a? c(5) b? -> a: 10+20=30; b: 20+10+5=35 (a was refreshed? no: lookups do not refresh)
    keys = ["a", "b", "a", "c", "b", "z"]
    vals = [10, 20, -2, 5, -3, -4]
    d, w = lookup_distances(keys, vals)
    assert d == [30, 25, float("inf")] and w == [1, 2, 3]


def test_sampling_keeps_the_curve_close():
    # Many keys of mild popularity skew, like the chunks of many sessions.
    rng = random.Random(3)
    s = _Stream()
    for _ in range(40000):
        k = hash((int(rng.expovariate(1 / 2000)), 1))  # keys are hashes, as in the simulator
        s.keys.append(k)
        s.vals.append(-129 if rng.random() < 0.5 else 8192)
        s.times.append(0.0)
    rec = StreamRecorder(0.25)
    sampled = _Stream(looked_up=sum(-v - 1 for v in s.vals if v < -1))
    for k, v, t in zip(s.keys, s.vals, s.times):
        if rec.sampled(k):
            sampled.keys.append(k)
            sampled.vals.append(v)
            sampled.times.append(t)
    total = sum(-v - 1 for v in s.vals if v < -1)
    caps = [4 << 20, 16 << 20, 64 << 20]
    exact = lru_curve([s], caps, 1.0, total)
    approx = lru_curve([sampled], caps, 0.25, total)
    assert approx == pytest.approx(exact, abs=0.04)
    assert exact[0] < 0.7 * exact[-1]


def test_shared_curve_is_a_replay_of_the_collector():
    rng = random.Random(4)
    s = _Stream()
    t = 0.0
    for _ in range(2000):
        t += rng.expovariate(1.0)
        k = rng.randrange(200)
        kind = rng.random()
        s.keys.append(k)
        s.times.append(t)
        s.vals.append(8192 if kind < 0.5 else (-1 if kind < 0.7 else -17))
    args = {"high_watermark": 0.9, "low_watermark": 0.7, "touch_interval_s": 10.0, "gc_interval_s": 30.0}
    caps = [50 * 8192, 150 * 8192, 400 * 8192]
    total = sum(-v - 1 for v in s.vals if v < -1)
    got = shared_curve([s], caps, 1.0, total, args)
    for cap, y in zip(caps, got):
        m, held = SharedModel(cap, **args), 0
        for k, v, tt in zip(s.keys, s.vals, s.times):
            if v >= 0:
                m.store(k, v, tt)
            elif v == -1:
                m.read(k, tt)
            elif k in m:
                held += 16
        assert y == held / total
    assert got[0] < got[-1]
