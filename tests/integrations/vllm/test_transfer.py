"""The device data path's ordering (transfer.py), without a GPU: a runtime
whose copies run at once on CPU tensors but whose events complete only when
the test says so. What must hold: the engine's stream waits on every copy,
a load is reported to vLLM only once its copies completed, a save reaches
the store only once its copy completed, and a staging buffer is reused only
after its copy completed. (On a GPU, scripts/gpu_check.py runs the real
streams.)"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from kvtier.codec import encode
from kvtier.config import parse_store_config
from kvtier.integrations.vllm.metadata import ChunkIO, KVTierMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.transfer import DevicePath, Staging
from tests.integrations.vllm.test_worker import _block_holds, _payload, _worker
from kvtier.integrations.vllm.settings import Topology
from tests.support import keys_for


class Event:
    def __init__(self, complete=False):
        self.complete = complete
        self.waited = False

    def query(self):
        return self.complete

    def synchronize(self):
        self.waited = True
        self.complete = True  # the host waited for the copy


class FakeRuntime:
    def __init__(self):
        self.done: list[Event] = []
        self.engine_waited: list[Event] = []
        self.pinned_allocs = 0

    def mark(self):
        return Event(True)

    def copying(self, after):
        return contextlib.nullcontext()

    def done_event(self):
        ev = Event()
        self.done.append(ev)
        return ev

    def engine_waits(self, ev):
        self.engine_waited.append(ev)

    def pinned(self, nbytes):
        self.pinned_allocs += 1
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def rig(tmp_path):
    cfg = parse_store_config({"chunk_tokens": 16, "load_timeout_s": 60, "tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1MiB", "io_threads": 2}]})
    worker, caches = _worker(cfg, Topology(1, 0))
    rt = FakeRuntime()
    worker.device = DevicePath(worker.layout, rt, Staging(rt, keep=2))
    from kvtier.concurrency.executor import PriorityExecutor

    worker._saver = PriorityExecutor("test-save", 1)
    yield worker, caches, rt
    worker.close()


def test_a_load_is_reported_only_once_its_copies_completed(rig):
    worker, caches, rt = rig
    keys = keys_for(11, 2)
    shape = worker.layout.chunk_shape(1)
    worker.store.tier("disk").store([encode(k, "float16", shape, _payload(i, shape).numpy().tobytes())
                                     for i, k in enumerate(keys)])
    job = LoadJob("r", [ChunkIO(k, [i + 3]) for i, k in enumerate(keys)], ["disk", "disk"])
    worker.start_load_kv(KVTierMetadata(loads=[job]))
    deadline = time.monotonic() + 10
    while len(rt.done) < 2:  # both chunks read and their copies enqueued
        assert time.monotonic() < deadline
        _, finished = worker.get_finished(set(), idle=True)
        assert not finished, "reported before the device copies completed"
    assert rt.engine_waited == rt.done  # the engine's stream is ordered after each copy
    assert worker.get_finished(set(), idle=True)[1] is None
    rt.done[0].complete = True
    assert worker.get_finished(set(), idle=True)[1] is None  # one copy still running
    rt.done[1].complete = True
    assert worker.get_finished(set(), idle=True)[1] == {"r"}
    assert _block_holds(caches, 3, 1) and _block_holds(caches, 4, 2)
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_save_reaches_the_store_only_after_its_copy(rig):
    worker, caches, rt = rig
    for t in caches.values():
        t[5].fill_(7.0)
    key = keys_for(12, 1)[0]
    worker.wait_for_save(KVTierMetadata(saves=[SaveJob("s", [ChunkIO(key, [5])])]))
    assert len(rt.done) == 1 and rt.engine_waited == rt.done
    assert worker.store.flush(10)
    deadline = time.monotonic() + 10
    stored = worker._key(key)
    while worker.store.lookup([stored]).chunks < 1:
        assert time.monotonic() < deadline, "the save never reached the store"
        time.sleep(0.01)
    assert rt.done[0].waited  # the saver waited on the copy's event first
    (obj,) = list(worker.store.fetch([stored]))
    assert bool((torch.frombuffer(obj.payload, dtype=torch.float16) == 7.0).all())


def test_staging_is_reused_only_after_its_copy_completed():
    rt = FakeRuntime()
    st = Staging(rt, keep=1)
    a = st.take(100)
    b = st.take(100)  # a is still in use: a new buffer
    assert a is not b and rt.pinned_allocs == 2
    st.give(a)
    assert st.take(50) is a and rt.pinned_allocs == 2
