"""The real store the planner's models are checked against, and the access
sequence the tier-model tests replay through both.

``three_tier_store`` is a ``TieredStore`` over a memory, a disk and a
shared-directory tier of ``MEM``, ``DISK`` and ``SHARED`` bytes. Each file
tier has one I/O thread, so reads and writes run in key order as in the
models; the shared tier's collector and access stamps run only when the
test calls them (``gc_interval_s`` and ``touch_interval_s`` 0).

The shared tier orders objects by mtime. The kernel stamps a new file with
its coarse clock while kvtier's access stamps (``os.utime``) are exact, and
the coarse clock may lag the exact one by more than a tick (6.5 ms measured
in a Firecracker VM whose tick is 4 ms): a write that follows a touch can
look older than it. The file system's clock is not the policy under test,
so the store stamps each new shared object exactly once it is written."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.keys import chunk_keys
from kvtier.plan.storemodel import StoreModel
from tests.support import NS, OBJ, obj_for, tokens_for

MEM, DISK, SHARED = 6 * OBJ, 11 * OBJ, 17 * OBJ
HIGH, LOW = 0.9, 0.6
STEPS = 60


def three_tier_store(tmp_path: Path, chunk_tokens: int, eviction: tuple[str, str, str] | None = None) -> TieredStore:
    """The store, its folders under ``tmp_path``; ``eviction``: the
    (memory, disk, shared) policies, each tier's default where None."""
    (tmp_path / "shared").mkdir()  # a shared tier's folder must exist (a mount point)
    specs = [
        {"kind": "memory", "capacity": f"{MEM}B"},
        {"kind": "disk", "capacity": f"{DISK}B", "path": str(tmp_path / "disk"), "io_threads": 1},
        {"kind": "shared", "capacity": f"{SHARED}B", "path": str(tmp_path / "shared"), "io_threads": 1,
         "gc_interval_s": 0, "touch_interval_s": 0, "high_watermark": HIGH, "low_watermark": LOW},
    ]
    for spec, policy in zip(specs, eviction or ()):
        spec["eviction"] = policy
    store = TieredStore(parse_store_config({"tiers": specs, "chunk_tokens": chunk_tokens}))
    shared_dir = store.tier("shared").dir
    write = shared_dir.write

    def stamped_exactly(obj, key, fsync):
        write(obj, key, fsync)
        shared_dir.touch(key, time.time())

    shared_dir.write = stamped_exactly
    return store


def step_clock() -> Callable[[], float]:
    """A model's clock: 1, 2, 3 ... one tick a call, so every access has a stamp of its own."""
    clock = iter(range(1, 1 << 30))
    return lambda: float(next(clock))


def tier_contents(store: TieredStore) -> tuple[list[int], list[int], set[int]]:
    """What each tier holds: memory and disk in their eviction order, the shared tier as a set."""
    mem = [int.from_bytes(d[:8], "little") for d in store.tier("memory")._entries]
    disk = [int.from_bytes(d[:8], "little") for d in store.tier("disk")._index]
    shared = {int.from_bytes(bytes.fromhex(e.key_hex)[:8], "little") for e in store.tier("shared").dir.scan()}
    return mem, disk, shared


def _ikey(k) -> int:
    return int.from_bytes(k.digest[:8], "little")


def _model_contents(model: StoreModel) -> tuple[list[int], list[int], set[int]]:
    (_, mem), (_, disk), (_, shared) = model.tiers
    return list(mem.entries), list(disk.entries), set(shared.stamps)


def replay(store: TieredStore, model: StoreModel, seed: int) -> tuple[int, int]:
    """One random access sequence through both: after every step the
    lookups, the chunks served, the collector's deletions and every tier's
    contents must match, and at the end every tier must have evicted alike
    and at least once (so each policy was exercised). Returns the chunks
    served by the store and by the model."""
    rng = random.Random(seed)
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

        assert tier_contents(store) == _model_contents(model), f"step {step}: tier contents differ"
    for name, (_, m) in zip(names, model.tiers):
        real = store.metrics.value("kvtier_evicted_chunks_total", tier=name)
        assert real == m.evictions > 0, name
    return served_real, served_model
