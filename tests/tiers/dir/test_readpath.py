"""Adaptive reads: the directory tiers read each load by the path (O_DIRECT or
buffered) their recent loads read faster, and try the other now and then."""

from __future__ import annotations

import pytest

from kvtier.metrics import Metrics
from kvtier.tiers.dir.readpath import BUFFERED, DIRECT, ReadPathChooser
from kvtier.tiers.shared import SharedTier
from tests.support import OBJ, assert_object, make_chunks, shared_config

MB = 1 << 20


def test_buffered_reads_must_be_faster_by_the_margin():
    c = ReadPathChooser(explore_every=100, min_bytes=MB, margin=1.15, warmup=0)
    c.pick(); c.record(DIRECT, 100 * MB, 1.0)
    c.pick(); c.record(BUFFERED, 110 * MB, 1.0)  # faster, within the margin: O_DIRECT costs less CPU
    assert {c.pick() for _ in range(5)} == {DIRECT}
    c.record(BUFFERED, 200 * MB, 1.0)  # now clearly faster
    assert {c.pick() for _ in range(5)} == {BUFFERED}


def test_each_path_is_measured_first_then_the_faster_is_taken():
    c = ReadPathChooser(explore_every=4, min_bytes=MB, warmup=0)
    assert c.pick() == DIRECT
    c.record(DIRECT, 100 * MB, 1.0)  # 100 MB/s
    assert c.pick() == BUFFERED
    c.record(BUFFERED, 200 * MB, 1.0)  # 200 MB/s
    picks = [c.pick() for _ in range(12)]
    # Every 4th pick (counting all picks) explores the slower path.
    assert picks.count(DIRECT) == 3 and picks.count(BUFFERED) == 9
    assert [i for i, p in enumerate(picks, start=3) if p == DIRECT] == [4, 8, 12]


def test_a_change_of_regime_moves_the_choice():
    c = ReadPathChooser(explore_every=4, weight=0.5, min_bytes=MB, warmup=0)
    c.pick(); c.record(DIRECT, 300 * MB, 1.0)
    c.pick(); c.record(BUFFERED, 100 * MB, 1.0)
    assert c.pick() == DIRECT
    # The direct path slows down to a third: the next loads notice and move.
    for _ in range(4):
        c.record(DIRECT, 50 * MB, 1.0)
    assert c.rates()[DIRECT] < c.rates()[BUFFERED]
    assert [c.pick() for _ in range(3)].count(BUFFERED) >= 2


def test_small_loads_do_not_count():
    c = ReadPathChooser(min_bytes=8 * MB, warmup=0)
    assert c.record(DIRECT, 1 * MB, 0.001) is None
    assert c.rates() == {DIRECT: None, BUFFERED: None}
    assert c.pick() == DIRECT  # still unmeasured
    assert c.record(DIRECT, 16 * MB, 0.1) == pytest.approx(160 * MB)


def test_each_paths_first_load_is_not_counted():
    c = ReadPathChooser(min_bytes=MB)  # warmup=1
    assert c.pick() == DIRECT
    assert c.record(DIRECT, 10 * MB, 1.0) is None  # its set-up (fresh buffers, ...) is not its speed
    assert c.pick() == DIRECT  # still unmeasured
    assert c.record(DIRECT, 100 * MB, 1.0) == pytest.approx(100 * MB)
    assert c.pick() == BUFFERED
    assert c.record(BUFFERED, 10 * MB, 1.0) is None


def test_explore_every_must_leave_room_for_the_best():
    with pytest.raises(ValueError):
        ReadPathChooser(explore_every=1)


def _tier(tmp_path, metrics, **kw):
    return SharedTier(shared_config(tmp_path / "shared", 64 * OBJ, **kw), metrics)


def test_an_adaptive_tier_reads_by_both_paths_and_serves_the_same_objects(tmp_path):
    metrics = Metrics()
    c = make_chunks(6)
    with _tier(tmp_path, metrics, adaptive_reads=True) as tier:
        assert tier.config.o_direct and tier.config.aio  # the defaults
        tier._paths = ReadPathChooser(explore_every=2, min_bytes=0, warmup=0)
        assert tier.store(c.objs) == 6
        for _ in range(6):
            tier.drop_cache()
            got = list(tier.fetch(c.keys))
            assert len(got) == 6
            for obj, key in zip(got, c.keys):
                assert_object(obj, key)
                tier.done_with(obj)
        loads = {p: metrics.value("kvtier_read_path_loads_total", tier="shared", path=p) for p in (DIRECT, BUFFERED)}
        assert loads[DIRECT] >= 2 and loads[BUFFERED] >= 2 and sum(loads.values()) == 6
        for p in (DIRECT, BUFFERED):
            assert metrics.value("kvtier_read_path_rate_bytes_per_second", tier="shared", path=p) > 0
            assert tier._paths.rates()[p] > 0


@pytest.mark.parametrize("opts, path", [({}, DIRECT), ({"o_direct": False, "adaptive_reads": True}, BUFFERED)],
                         ids=["default", "buffered"])
def test_without_adaptive_reads_every_load_takes_the_configured_path(tmp_path, opts, path):
    metrics = Metrics()
    c = make_chunks(4)
    with _tier(tmp_path, metrics, **opts) as tier:
        tier._paths = ReadPathChooser(explore_every=2, min_bytes=0, warmup=0)
        tier.store(c.objs)
        for _ in range(4):
            for obj in tier.fetch(c.keys):
                tier.done_with(obj)
        assert metrics.value("kvtier_read_path_loads_total", tier="shared", path=path) == 4
        other = BUFFERED if path == DIRECT else DIRECT
        assert metrics.value("kvtier_read_path_loads_total", tier="shared", path=other) == 0
        # Each load's rate is measured (an operator's view) even where it chooses nothing.
        assert metrics.value("kvtier_read_path_rate_bytes_per_second", tier="shared", path=path) > 0
