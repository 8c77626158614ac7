"""The simulator's tier models against the real tiers: one access sequence
through ``StoreModel`` (LRU memory, LRU disk, shared watermark collector)
and through ``TieredStore`` over real ``MemoryTier``, ``DiskTier`` and
``SharedTier`` directories, with tiny chunks. After every step both must
hold the same objects in the same recency order, answer lookups alike and
have evicted the same number of objects.

The shared tier orders objects by mtime. The kernel stamps a new file with
its coarse clock while kvtier's access stamps (``os.utime``) are exact, and
the coarse clock may lag the exact one by more than a tick (6.5 ms measured
in a Firecracker VM whose tick is 4 ms): a write that follows a touch can
look older than it. The file system's clock is not the policy under test,
so the test stamps each new shared object exactly once it is written."""

from __future__ import annotations

import random
import time

import pytest

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.keys import chunk_keys
from kvtier.plan.models import LRUModel, SharedModel
from kvtier.plan.storemodel import StoreModel
from tests.support import BYTES_PER_TOKEN, NS, OBJ, obj_for, tokens_for

MEM, DISK, SHARED = 6 * OBJ, 11 * OBJ, 17 * OBJ
HIGH, LOW = 0.9, 0.6
STEPS = 60


def _ikey(k) -> int:
    return int.from_bytes(k.digest[:8], "little")


@pytest.fixture
def pair(tmp_path):
    (tmp_path / "shared").mkdir()  # a shared tier's folder must exist (a mount point)
    specs = [
        {"kind": "memory", "capacity": f"{MEM}B"},
        # One I/O thread: reads and writes run in key order, as in the model.
        {"kind": "disk", "capacity": f"{DISK}B", "path": str(tmp_path / "disk"), "io_threads": 1},
        {"kind": "shared", "capacity": f"{SHARED}B", "path": str(tmp_path / "shared"), "io_threads": 1,
         "gc_interval_s": 0, "touch_interval_s": 0, "high_watermark": HIGH, "low_watermark": LOW},
    ]
    store = TieredStore(parse_store_config({"tiers": specs, "chunk_tokens": NS.chunk_tokens}))
    shared_dir = store.tier("shared").dir
    write = shared_dir.write

    def stamped_exactly(obj, key, fsync):
        write(obj, key, fsync)
        shared_dir.touch(key, time.time())

    shared_dir.write = stamped_exactly
    clock = iter(range(1, 1 << 30))
    shared = SharedModel(SHARED, HIGH, LOW, touch_interval_s=0, gc_interval_s=0)
    model = StoreModel([("memory", LRUModel(MEM)), ("disk", LRUModel(DISK)), ("shared", shared)],
                       BYTES_PER_TOKEN, lambda: float(next(clock)))
    yield store, model
    store.close()


def _state(store: TieredStore) -> tuple[list[int], list[int], set[int]]:
    mem = [int.from_bytes(d[:8], "little") for d in store.tier("memory")._entries]
    disk = [int.from_bytes(d[:8], "little") for d in store.tier("disk")._index]
    shared = {int.from_bytes(bytes.fromhex(e.key_hex)[:8], "little") for e in store.tier("shared").dir.scan()}
    return mem, disk, shared


def _model_state(model: StoreModel) -> tuple[list[int], list[int], set[int]]:
    (_, mem), (_, disk), (_, shared) = model.tiers
    return list(mem.entries), list(disk.entries), set(shared.stamps)


def test_one_access_sequence_gives_the_same_hits_and_evictions(pair):
    store, model = pair
    rng = random.Random(7)
    names = [t.name for t in store.tiers]
    sessions = [tokens_for(s, 8 * NS.chunk_tokens + 5) for s in range(6)]
    served_real = served_model = 0
    for step in range(STEPS):
        # A session's prefix, often ending in a partial chunk; hot sessions come back more.
        s = min(int(rng.expovariate(0.35)), len(sessions) - 1)
        n_tokens = rng.randint(1, len(sessions[s]))
        keys = chunk_keys(NS, sessions[s][:n_tokens])
        chunks = [(_ikey(k), k.num_tokens) for k in keys]

        plan = store.lookup(keys)
        real_holders = [names.index(seg.tier) for seg in plan.segments for _ in range(seg.start, seg.stop)]
        assert real_holders == model.lookup(chunks), f"step {step}: lookups differ"

        hit = plan.chunks
        if hit and rng.random() < 0.8:
            n_real = sum(1 for _ in store.fetch(keys[:hit]))
            n_model, _ = model.fetch(chunks[:hit])
            assert n_real == n_model
            served_real += n_real
            served_model += n_model
        # Saves: what was missing, sometimes everything again (a re-store refreshes).
        start = 0 if rng.random() < 0.25 else hit
        objs = [obj_for(k) for k in keys[start:]]
        store.put(objs)
        for o in objs:
            o.release()
        assert store.flush(10)
        model.put(chunks[start:])
        if step % 5 == 4:
            real_gc = store.tier("shared").gc()
            assert real_gc.deleted == model.tiers[2][1].gc()

        assert _state(store) == _model_state(model), f"step {step}: tier contents differ"
    assert served_real == served_model > 0
    for name, (_, m) in zip(names, model.tiers):
        real = store.metrics.value("kvtier_evicted_chunks_total", tier=name)
        # Every tier evicted, so the comparison exercised each policy.
        assert real == m.evictions > 0, name
