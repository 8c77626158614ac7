"""Case 9: evictions and deletes race with loads.

Readers load sessions while writers store new ones (forcing evictions in a
tier far smaller than the working set) and a deleter removes random chunks.
Every read must be a miss or the complete, right object; nothing may raise;
the tier's accounting must never go negative nor, where the tier enforces
capacity synchronously (memory, disk, redis), above its capacity. Tiers that
enforce capacity by watermark collection (shared, s3) must be back under it
after one pass.
"""

from __future__ import annotations

import random
import threading
import time

from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from tests.support import DTYPE, OBJ, disk_config, keys_for, memory_config, objs_for, payload_for, shape_for, shared_config

SESSIONS = 12
CHUNKS = 3
SYNC_CAPACITY = {"memory", "disk", "redis"}


def _race(duration: float, workers: dict, check) -> list[str]:
    errors: list[str] = []
    stop = threading.Event()

    def loop(name, fn, seed):
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                fn(rng)
                check()
        except BaseException as exc:  # collected: the test fails with it
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            stop.set()

    threads = [threading.Thread(target=loop, args=(n, fn, i)) for i, (n, fn) in enumerate(workers.items())]
    for t in threads:
        t.start()
    stop.wait(duration)
    stop.set()
    for t in threads:
        t.join(30)
    return errors


def test_evict_and_delete_during_loads(harness):
    capacity = 5 * OBJ
    tier = harness.open(capacity)
    sessions = [keys_for(1000 + s, CHUNKS) for s in range(SESSIONS)]
    seen = {"loaded": 0, "min_used": 0, "max_used": 0}

    def check():
        used = tier.stats().used_bytes
        seen["min_used"] = min(seen["min_used"], used)
        seen["max_used"] = max(seen["max_used"], used)
        assert used >= 0, f"used bytes went negative: {used}"
        if harness.kind in SYNC_CAPACITY:
            assert used <= capacity, f"used bytes {used} above capacity {capacity}"

    def load(rng):
        keys = rng.choice(sessions)
        for i, obj in enumerate(tier.fetch(keys)):
            try:
                assert obj.header.matches(keys[i]) and bytes(obj.payload) == payload_for(keys[i]), "wrong object"
                seen["loaded"] += 1
            finally:
                if tier.persistent:
                    obj.release()

    def store(rng):
        tier.store(objs_for(rng.choice(sessions)))

    def delete(rng):
        tier.delete([rng.choice(rng.choice(sessions))])
        time.sleep(0.001)

    errors = _race(1.5, {"load-1": load, "load-2": load, "store-1": store, "store-2": store, "delete": delete}, check)
    assert not errors, errors
    assert seen["loaded"] > 0, "no load ever hit: the race was never run"
    harness.settle(tier)
    used = tier.stats().used_bytes
    assert 0 <= used <= capacity, used
    if harness.kind in ("disk", "shared", "shared-buffered", "shared-adaptive"):
        on_disk = sum(e.size for e in tier.dir.scan())
        assert on_disk <= capacity, f"{on_disk} B of objects on disk, capacity {capacity}"


def test_tiered_store_loads_during_evictions_and_clears(tmp_path):
    """The whole stack: loads promote into a small memory tier while writers
    evict from every tier and another thread clears the disk tier."""
    cfg = StoreConfig(tiers=(
        TierSpec("memory", memory_config(4 * OBJ)),
        TierSpec("disk", disk_config(tmp_path / "disk", 6 * OBJ)),
        TierSpec("shared", shared_config(tmp_path / "shared", 8 * OBJ)),
    ))
    sessions = [keys_for(2000 + s, CHUNKS) for s in range(SESSIONS)]
    loaded = [0]
    with TieredStore(cfg, Metrics()) as store:
        limits = {t.name: t.stats().capacity_bytes for t in store.tiers}

        def check():
            for st in store.stats():
                assert st.used_bytes >= 0, st
                if st.kind != "shared":
                    assert st.used_bytes <= limits[st.name], st

        def load(rng):
            keys = rng.choice(sessions)
            bufs = [bytearray(len(payload_for(k))) for k in keys]
            n = store.load(keys, bufs)
            for k, b in zip(keys[:n], bufs):
                assert bytes(b) == payload_for(k), "a load returned the wrong bytes"
            loaded[0] += n

        def save(rng):
            keys = rng.choice(sessions)
            store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
            time.sleep(0.002)

        def clear(rng):
            time.sleep(0.05)
            store.tier("disk").clear()
            store.tier("memory").clear()

        errors = _race(1.5, {"load-1": load, "load-2": load, "save": save, "clear": clear}, check)
        assert not errors, errors
        assert store.flush(30)
        check()
        assert store.tier("shared").gc().ran
        assert 0 <= store.tier("shared").stats().used_bytes <= limits["shared"]
    assert loaded[0] > 0
