"""Case 7 through the whole store, on both directory tiers: a flipped byte,
a truncated or zero-length file, a wrong header version → the load ends at
the bad chunk (the rest is recomputed), nothing raises, the failure is
counted and the object quarantined; a later save stores it whole again.

(The shared tier alone: tests/tiers/test_shared.py; every byte position and
length: tests/test_codec.py; Redis and S3: tests/tiers/redis/test_redis.py and
tests/tiers/s3/test_s3.py; inside vLLM: tests/integrations/vllm/test_e2e.py.)
"""

from __future__ import annotations

import os

import pytest

from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from tests.support import DTYPE, disk_config, keys_for, payload_for, shape_for, shared_config
from tests.tiers.test_shared import CORRUPTIONS


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_damaged_object_ends_the_load_and_is_quarantined(tmp_path, kind, corrupt):
    spec = disk_config(tmp_path / kind) if kind == "disk" else shared_config(tmp_path / kind)
    metrics = Metrics()
    keys = keys_for(77, 3)
    with TieredStore(StoreConfig(tiers=(TierSpec(kind, spec),)), metrics) as store:
        def save():
            store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
            assert store.flush(10)

        def load() -> int:
            bufs = [bytearray(len(payload_for(k))) for k in keys]
            n = store.load(keys, bufs)
            assert [bytes(b) for b in bufs[:n]] == [payload_for(k) for k in keys[:n]]
            return n

        save()
        tier = store.tier(kind)
        path = tier.dir.path(keys[1])
        CORRUPTIONS[corrupt](path)
        assert load() == 1
        # (A load looks the last tier up no more: its read meets the damage,
        # the zero-length file included, which a lookup of the shared tier
        # answers as a miss before anything is read.)
        assert metrics.value("kvtier_integrity_failures_total", tier=kind) == 1
        assert not path.exists()
        assert [q.startswith(keys[1].hex) for q in os.listdir(tier.dir.quarantine_dir)] == [True]
        save()  # the recomputed chunk is stored again
        assert load() == 3
