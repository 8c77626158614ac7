"""Case 3: a collision of the naming digest is detected, counted, and never
serves foreign KV.

The test hook ``keys._TRUNCATE_DIGEST_FOR_TESTS`` keeps only the first byte
of every naming digest, so among a few hundred one-chunk prompts two collide:
their objects have the same name in every tier, but their key check (the
independent BLAKE2b chain each object echoes) differs.
"""

from __future__ import annotations

import pytest

from kvtier import keys as keys_mod
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.keys import chunk_keys
from kvtier.metrics import Metrics
from tests.support import NS, DTYPE, disk_config, memory_config, obj_for, payload_for, shape_for, shared_config, tokens_for


@pytest.fixture
def truncated(monkeypatch):
    monkeypatch.setattr(keys_mod, "_TRUNCATE_DIGEST_FOR_TESTS", 1)
    yield
    keys_mod._FULL.clear()


def colliding_pair():
    """Two one-chunk prompts with different tokens whose (truncated) naming
    digests are equal."""
    seen = {}
    for seed in range(1000):
        toks = tokens_for(seed, NS.chunk_tokens)
        (key,) = chunk_keys(NS, toks)
        if key.digest in seen:
            other_toks, other = seen[key.digest]
            assert other_toks != toks and other.check != key.check
            return other, key
        seen[key.digest] = (toks, key)
    raise AssertionError("no collision among 1000 prompts with a 1-byte digest")


def integrity_failures(metrics: Metrics, tier: str) -> float:
    return metrics.value("kvtier_integrity_failures_total", tier=tier)


def test_a_colliding_key_never_gets_the_other_chunks_kv(truncated, harness, metrics):
    tier = harness.open()
    a, b = colliding_pair()
    assert a.digest == b.digest  # same name in every tier
    assert tier.store([obj_for(a)]) == 1
    before = integrity_failures(metrics, tier.name)

    # b's lookup may see a name (the persistent tiers check names), but no
    # fetch or load may hand over a's object for b.
    assert list(tier.fetch([b])) == []
    buf = bytearray(len(payload_for(b)))
    assert tier.load([b], [buf]) == 0
    assert bytes(buf) != payload_for(a)
    assert tier.lookup([b]) in (0, 1)
    assert integrity_failures(metrics, tier.name) > before, "the collision was not counted"


def test_the_rightful_owner_still_hits_until_the_name_is_reclaimed(truncated, harness, metrics):
    """After b's failed read, a either still hits with its own, verified
    object, or misses (its object was quarantined as doubtful): never b's."""
    tier = harness.open()
    a, b = colliding_pair()
    tier.store([obj_for(a)])
    list(tier.fetch([b]))
    got = [bytes(o.payload) for o in tier.fetch([a])]
    assert got in ([], [payload_for(a)])
    # b now stores its own KV under the shared name; a must not get it.
    tier.store([obj_for(b)])
    for obj in tier.fetch([a]):
        assert bytes(obj.payload) == payload_for(a)


@pytest.mark.parametrize("stack", ["memory", "disk", "shared", "memory+disk+shared"])
def test_a_tiered_store_loads_nothing_for_a_colliding_key(truncated, tmp_path, stack):
    metrics = Metrics()
    specs = {
        "memory": TierSpec("memory", memory_config()),
        "disk": TierSpec("disk", disk_config(tmp_path / "disk")),
        "shared": TierSpec("shared", shared_config(tmp_path / "shared")),
    }
    cfg = StoreConfig(tiers=tuple(specs[k] for k in stack.split("+")))
    a, b = colliding_pair()
    with TieredStore(cfg, metrics) as store:
        store.save([a], [payload_for(a)], DTYPE, [shape_for(a.num_tokens)])
        assert store.flush(10)
        buf = bytearray(len(payload_for(b)))
        assert store.load([b], [buf]) == 0
        assert bytes(buf) != payload_for(a)
        failures = sum(integrity_failures(metrics, t.name) for t in store.tiers)
        assert failures >= 1
        # ... and the owner's own prefix is either served verified or recomputed.
        buf_a = bytearray(len(payload_for(a)))
        n = store.load([a], [buf_a])
        assert n == 0 or bytes(buf_a) == payload_for(a)
