"""The connector's worker side, run without an engine: real TieredStore (memory
in front of a disk tier), CPU tensors shaped like vLLM's CPU KV cache, and
the load protocol vLLM drives (start_load_kv, then get_finished every step).
Engine behaviour itself is tested end to end in test_e2e.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.codec import encode
from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm import runtime
from kvtier.integrations.vllm.metadata import ChunkIO, KVTierMetadata, LoadJob
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.worker import KVTierWorker
from tests.support import NS, keys_for

BS = NS.chunk_tokens  # one engine block per chunk
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NS.num_layers)]
NUM_BLOCKS = 8


@pytest.fixture
def rig(tmp_path):
    # A long load timeout: waiting for the whole prefetch would show as a stall.
    cfg = parse_store_config({"chunk_tokens": BS, "load_timeout_s": 60, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB", "io_threads": 4}]})
    store = TieredStore(cfg)
    worker = KVTierWorker(Settings(cfg, NS, BS, NS.num_layers, "float16"), store, LAYERS, NUM_BLOCKS)
    # vLLM's CPU attention layout: [blocks, kv heads, block size, 2 * head dim].
    caches = {n: torch.zeros(NUM_BLOCKS, NS.num_kv_heads, BS, 2 * NS.head_dim, dtype=torch.float16) for n in LAYERS}
    worker.register_kv_caches(caches)
    yield store, worker, caches
    worker.close()
    store.close()


def _payload(i: int, shape) -> torch.Tensor:
    return torch.full(shape, float(i + 1), dtype=torch.float16)


def _block_holds(caches, block: int, value: float) -> bool:
    return all(bool((t[block] == value).all()) for t in caches.values())


def test_prefetched_chunks_are_copied_in_while_later_ones_are_still_read(rig):
    """A load fed by the prefetch its lookup started copies each chunk as soon
    as the prefetch stored it: it does not wait for the whole read."""
    store, worker, caches = rig
    keys = keys_for(5, 6)
    shape = worker.layout.chunk_shape(1)
    objs = [encode(k, "float16", shape, _payload(i, shape).numpy().tobytes()) for i, k in enumerate(keys)]
    disk = store.tier("disk")
    disk.store(objs)
    gate = threading.Event()
    read = disk._read_one

    def held_back_after_three(key):
        if keys.index(key) >= 3:
            assert gate.wait(10)
        return read(key)

    disk._read_one = held_back_after_three
    runtime.set_prefetch("r1", store.prefetch(keys))
    job = LoadJob("r1", [ChunkIO(k, [i + 1]) for i, k in enumerate(keys)], ["disk"] * len(keys))
    worker.start_load_kv(KVTierMetadata(loads=[job]))

    deadline = time.monotonic() + 5
    while not all(_block_holds(caches, i + 1, i + 1) for i in range(3)):
        assert time.monotonic() < deadline, "the first chunks were not copied in while the rest was held back"
        _, finished = worker.get_finished(set(), idle=True)
        assert not finished  # chunks 3-5 are not read yet
    assert not _block_holds(caches, 4, 4)

    gate.set()
    done: set[str] = set()
    while "r1" not in done:
        assert time.monotonic() < deadline + 10, "the load never finished"
        _, finished = worker.get_finished(set(), idle=True)
        done |= finished or set()
    assert all(_block_holds(caches, i + 1, i + 1) for i in range(6))
    assert worker.get_block_ids_with_load_errors() == set()
    assert runtime.pop_prefetch("r1") is None


def test_a_prefetch_that_stops_short_leaves_the_rest_to_the_load(rig):
    """Memory gives up on the prefetch after two chunks: the load reads the
    others from disk itself, and every block arrives."""
    store, worker, caches = rig
    keys = keys_for(6, 5)
    shape = worker.layout.chunk_shape(1)
    objs = [encode(k, "float16", shape, _payload(i, shape).numpy().tobytes()) for i, k in enumerate(keys)]
    store.tier("disk").store(objs)
    memory = store.tier("memory")
    stored = memory.store
    calls = []

    def refuse_after_two(batch):
        calls.append(len(batch))
        return stored(batch) if len(calls) <= 2 else 0

    memory.store = refuse_after_two
    pf = store.prefetch(keys)
    assert pf.result(10) == 2
    memory.store = stored
    runtime.set_prefetch("r2", pf)
    job = LoadJob("r2", [ChunkIO(k, [i + 1]) for i, k in enumerate(keys)], ["disk"] * len(keys))
    worker.start_load_kv(KVTierMetadata(loads=[job]))
    deadline = time.monotonic() + 10
    done: set[str] = set()
    while "r2" not in done:
        assert time.monotonic() < deadline, "the load never finished"
        _, finished = worker.get_finished(set(), idle=True)
        done |= finished or set()
    assert all(_block_holds(caches, i + 1, i + 1) for i in range(5))
    assert worker.get_block_ids_with_load_errors() == set()
