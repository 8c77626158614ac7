"""The simulator's request path against the connector's: the same requests
through ``Simulator.step`` and through the real ``KVTierScheduler`` over a
real ``TieredStore`` (memory, disk and shared directory tiers), its worker
side played by this test (loads: fetch the job's chunks; saves: put the
planned chunks), prefill then decode steps as vLLM
schedules them. Per request, the tokens each tier serves must be equal, and
after every request each tier must hold the same objects in the same order.

Marked slow: importing the connector imports vLLM (seconds of CPU)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from kvtier.bench.models import ModelShape
from kvtier.bench.workloads import hash_ids
from kvtier.codec import encode
from kvtier.keys import Namespace
from kvtier.plan.cost import DEFAULT_IO
from kvtier.plan.sim import PlanConfig, Simulator, TierPlan
from kvtier.plan.traces import Request, to_units
from tests.plan.tierpair import DISK, HIGH, LOW, MEM, SHARED, three_tier_store, tier_contents

pytestmark = pytest.mark.slow

BS, C = 4, 8  # engine block size, chunk tokens
NS = Namespace("m", "fp", "float32", "test", 1, 1, 4, chunk_tokens=C)
MODEL = ModelShape("t", 1, 1, 4, "float32")  # 32 bytes of KV per token, as the payloads below


@pytest.fixture
def pair(tmp_path):
    from kvtier.integrations.vllm.group import GroupView
    from kvtier.integrations.vllm.metrics import connector_metrics
    from kvtier.integrations.vllm.scheduler import KVTierScheduler
    from kvtier.integrations.vllm.settings import Settings
    from kvtier.integrations.vllm.topology import Topology

    store = three_tier_store(tmp_path, C)
    settings = Settings(store.config, NS, BS, 1, "float32", Topology(1, None))
    # The scheduler looks up in the store this test's worker side fills.
    sched = KVTierScheduler(settings, GroupView(settings, stores=[store]), connector_metrics())
    tiers = (TierPlan("memory", MEM, DEFAULT_IO["memory"]), TierPlan("disk", DISK, DEFAULT_IO["disk"]),
             TierPlan("shared", SHARED, DEFAULT_IO["shared"], HIGH, LOW, touch_interval_s=0, gc_interval_s=0))
    sim = Simulator(PlanConfig(MODEL, tiers, chunk_tokens=C, block_tokens=BS, curve_sample=0), keep_outcomes=True)
    yield sched, store, sim
    sched.close()  # closes the store too (its view owns it)


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def _step(new=(), cached=None, scheduled=None):
    cached = cached or SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {})


def _worker(store, meta) -> None:
    """What KVTierWorker does with a step's metadata, minus the engine's tensors."""
    for job in meta.loads:
        for _ in store.fetch([c.key for c in job.chunks]):
            pass
    for job in meta.saves:
        objs = [encode(c.key, "float32", (1, c.key.num_tokens // BS, 1, 2 * BS, 4), bytes(c.key.num_tokens * 32))
                for c in job.chunks]
        store.put(objs)
        for o in objs:
            o.release()
    assert store.flush(10)


def _serve(sched, store, rid: str, prompt: list[int], output: list[int]) -> dict[str, int]:
    """One request through the connector: lookup, prefill step, decode steps.
    Returns the tokens each tier served."""
    P, O = len(prompt), len(output)
    req = SimpleNamespace(request_id=rid, all_token_ids=list(prompt), num_tokens=P, num_prompt_tokens=P,
                          cache_salt=None, mm_features=None, lora_request=None, prompt_embeds=None)
    deadline = time.monotonic() + 10
    while True:
        n, _ = sched.get_num_new_matched_tokens(req, 0)
        if n is not None or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    st = sched._reqs[rid]
    hit = st.lookup.result() if st.lookup is not None else None
    served: dict[str, int] = {}
    if n and hit is not None:
        pos = 0
        for k, tier in zip(hit.keys, hit.tiers):
            a, b = pos, min(pos + k.num_tokens, n)
            if b > a:
                served[tier] = served.get(tier, 0) + b - a
            pos += k.num_tokens
    ids = list(range(-(-(P + O) // BS)))
    sched.update_state_after_alloc(req, _Blocks(ids), n)
    _worker(store, sched.build_connector_meta(_step(
        new=[SimpleNamespace(req_id=rid, block_ids=(ids,), num_computed_tokens=n)], scheduled={rid: P - n})))
    for i in range(1, O):  # decode: each step computes the token sampled by the previous one
        req.all_token_ids.append(output[i - 1])
        req.num_tokens += 1
        cached = SimpleNamespace(req_ids=[rid], new_block_ids=[None], num_computed_tokens=[P + i - 1],
                                 resumed_req_ids=set())
        _worker(store, sched.build_connector_meta(_step(cached=cached, scheduled={rid: 1})))
    sched.request_finished(req, ids)
    return served


def _contents(store):
    return tuple(len(held) for held in tier_contents(store))


def test_requests_through_the_simulator_and_the_connector_hit_the_same_tiers(pair):
    sched, store, sim = pair
    rng = random.Random(11)
    streams = [[rng.randrange(3, 5000) for _ in range(70)] for _ in range(6)]
    out_token = iter(range(10_000, 1 << 30))  # generated tokens never appear in a later prompt
    totals = {"memory": 0, "disk": 0, "shared": 0}
    for i in range(45):
        s = min(int(rng.expovariate(0.5)), len(streams) - 1)
        P = rng.randint(5, len(streams[s]))
        prompt = streams[s][:P]
        output = [next(out_token) for _ in range(rng.randint(1, 14))]
        real = _serve(sched, store, f"r{i}", prompt, output)
        req = Request(float(i), to_units(hash_ids(prompt, BS), BS, P, BS), P, len(output), session=s,
                      output_key=hash((0x6F7574, tuple(output))))
        simulated = sim.step(req).tier_tokens
        assert {k: v for k, v in real.items() if v} == {k: v for k, v in simulated.items() if v}, f"request {i}"
        for k, v in real.items():
            totals[k] += v
        if i % 6 == 5:
            assert store.tier("shared").gc().deleted == sim.shared.gc()
        st = sim.instances[0].store
        assert _contents(store) == (len(st.tiers[0][1].entries), len(st.tiers[1][1].entries),
                                    len(st.tiers[2][1].stamps)), f"request {i}"
    assert all(totals.values()), totals  # every tier served something
