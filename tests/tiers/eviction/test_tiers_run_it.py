"""Each tier runs the eviction policy its config names (``eviction``), and
refuses, as a ``ConfigError`` naming the key, one it cannot run."""

from __future__ import annotations

import os
import time

import pytest

from kvtier.config import parse_store_config
from kvtier.errors import ConfigError
from kvtier.metrics import Metrics
from kvtier.tiers.shared import SharedTier
from kvtier.tiers.shm import ShmConfig, ShmTier
from tests.support import OBJ, make_chunks, shared_config


def _present(tier, keys) -> list[int]:
    return [i for i, k in enumerate(keys) if tier.lookup([k])]


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("tier, name, said", [
    ({"kind": "memory", "capacity": "1MiB"}, "lru-ish", "unknown eviction policy"),
    ({"kind": "memory", "capacity": "1MiB"}, "watermark", "low_watermark"),
    ({"kind": "disk", "capacity": "1MiB", "path": "/tmp/kvtier-unused"}, "watermark", "low_watermark"),
    ({"kind": "shm", "capacity": "1MiB"}, "nope", "unknown eviction policy"),
    ({"kind": "shared", "capacity": "1MiB", "path": "/tmp"}, "nope", "unknown eviction policy"),
])
def test_a_policy_the_tier_cannot_run_is_a_config_error_naming_the_key(tier, name, said):
    with pytest.raises(ConfigError) as e:
        parse_store_config({"tiers": [{"kind": "memory", "capacity": "1MiB"}, {**tier, "eviction": name}]})
    assert e.value.key == "tiers[1].eviction"
    assert said in e.value.problem and e.value.fix.startswith("use one of: lru")


def test_each_kind_defaults_to_the_policy_it_has_always_run():
    cfg = parse_store_config({"tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "shm", "capacity": "1MiB"},
        {"kind": "disk", "capacity": "1MiB", "path": "/tmp/kvtier-unused"},
        {"kind": "shared", "capacity": "1MiB", "path": "/tmp"},
    ]})
    assert [t.config.eviction for t in cfg.tiers] == ["lru", "watermark", "lru", "watermark"]


# ---------------------------------------------------------------- shm


@pytest.mark.parametrize("eviction, held", [("watermark", 5), ("lru", 8)])
def test_shm_evicts_in_a_batch_under_watermark_and_just_enough_under_lru(node_dir, eviction, held):
    metrics = Metrics()
    tier = ShmTier(ShmConfig(capacity=8 * OBJ, path=node_dir, touch_interval_s=0.0, low_watermark=0.5,
                             eviction=eviction), metrics)
    try:
        c = make_chunks(9)
        assert tier.store(c.objs[:8]) == 8
        now = time.time()
        for i, k in enumerate(c.keys[:8]):  # stamps: chunk 0 the oldest
            os.utime(tier.dir.path(k), (now - 100 + i, now - 100 + i))
        assert tier.store(c.objs[8:]) == 1
        # watermark: down to min(capacity - 1 object, 0.5 x capacity) = 4 objects, then the new one.
        assert _present(tier, c.keys) == list(range(8 - (held - 1), 9))
        assert tier.stats().used_bytes == held * OBJ
        assert metrics.value("kvtier_evicted_chunks_total", tier=tier.name) == 9 - held
    finally:
        tier.close()


# ---------------------------------------------------------------- shared


def test_the_shared_collector_under_lru_collects_only_past_capacity_down_to_it(tmp_path):
    tier = SharedTier(shared_config(tmp_path / "shared", 10 * OBJ, high_watermark=0.5, low_watermark=0.3,
                                    eviction="lru"))
    try:
        c = make_chunks(12)
        tier.store(c.objs[:8])
        assert tier.gc().deleted == 0  # past the high watermark, within capacity: lru waits
        tier.store(c.objs[8:])
        now = time.time()
        for i, k in enumerate(c.keys):
            os.utime(tier.dir.path(k), (now - 100 + i, now - 100 + i))
        r = tier.gc()
        assert (r.deleted, r.bytes_after) == (2, 10 * OBJ)
        assert _present(tier, c.keys) == list(range(2, 12))
    finally:
        tier.close()


# ---------------------------------------------------------------- memory, disk: lfu


def _lfu_sequence(tier, c):
    """Four objects in a tier of four; 0 read three times, then 1, 2 and 3
    once each; a fifth object then needs room: under lru 0 goes (the least
    recently used), under lfu 1 (of the least used, the least recent)."""
    assert tier.store(c.objs[:4]) == 4
    for i in (0, 0, 0, 1, 2, 3):
        assert sum(1 for _ in _fetch(tier, c.keys[i:i + 1])) == 1
    assert tier.store(c.objs[4:5]) == 1


def _fetch(tier, keys):
    for obj in tier.fetch(keys):
        yield obj
        tier.done_with(obj)


@pytest.mark.parametrize("eviction, gone", [("lfu", 1), ("lru", 0)])
def test_memory_evicts_the_least_frequently_used_under_lfu(metrics, eviction, gone):
    from kvtier.tiers.memory import MemoryConfig, MemoryTier

    tier = MemoryTier(MemoryConfig(capacity=4 * OBJ, eviction=eviction), metrics)
    try:
        c = make_chunks(5)
        _lfu_sequence(tier, c)
        assert _present(tier, c.keys) == [i for i in range(5) if i != gone]
    finally:
        tier.close()


def test_disk_evicts_the_least_frequently_used_under_lfu(tmp_path, metrics):
    from tests.support import disk_config
    from kvtier.tiers.disk import DiskTier

    cfg = disk_config(tmp_path / "disk", 4 * OBJ, eviction="lfu", io_threads=1)
    tier = DiskTier(cfg, metrics)
    try:
        c = make_chunks(6)
        _lfu_sequence(tier, c)
        assert _present(tier, c.keys) == [0, 2, 3, 4]
    finally:
        tier.close()
    # Counts live in the process: reopened, every object has one use, in the
    # access log's order, so 0 (used the longest ago) goes first now.
    tier = DiskTier(cfg, metrics)
    try:
        assert tier.store(c.objs[5:]) == 1
        assert _present(tier, c.keys) == [2, 3, 4, 5]
    finally:
        tier.close()


def test_the_shared_tiers_refuse_lfu():
    for tier in ({"kind": "shm", "capacity": "1MiB"}, {"kind": "shared", "capacity": "1MiB", "path": "/tmp"}):
        with pytest.raises(ConfigError) as e:
            parse_store_config({"tiers": [{**tier, "eviction": "lfu"}]})
        assert e.value.key == "tiers[0].eviction" and "recency stamp" in e.value.problem
        assert e.value.fix == "use one of: lru, watermark"
