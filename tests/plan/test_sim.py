"""The simulator on workloads whose outcome is known by construction."""

from __future__ import annotations

from kvtier.bench.models import PRESETS
from kvtier.bench.workloads import ChatShape, w1, w2
from kvtier.plan.cost import DEFAULT_IO, PrefillModel
from kvtier.plan.sim import PlanConfig, Simulator, TierPlan
from kvtier.plan.synth import from_workload

GiB = 1 << 30
MODEL = PRESETS["qwen2.5-0.5b"]


def _reqs(workload, block_tokens=128):
    """The workload's requests in send order (phases one after the other)."""
    from kvtier.plan.loaders import load_kvtier_log

    return list(load_kvtier_log("log.jsonl", 128, records=list(from_workload(workload, block_tokens))))


def _cfg(tiers, **kw):
    kw.setdefault("engine_blocks", 18)
    return PlanConfig(MODEL, tuple(TierPlan(k, c, DEFAULT_IO[k]) for k, c in tiers), **kw)


def test_w1_resumes_hit_the_configured_tier_after_the_engine_evicted_them():
    reqs = _reqs(w1(3, 2048, vocab=1000))
    for kind in ("memory", "disk", "shared"):
        sim = Simulator(_cfg([(kind, 8 * GiB)])).run(reqs)
        t = sim.totals
        assert t.engine_tokens == 0
        assert t.tier_tokens == {kind: 3 * 1920}  # every whole block but the last of each resume
        assert t.prompt_tokens == 6 * 2048
    # An engine big enough keeps the sessions itself: kvtier is not asked.
    sim = Simulator(_cfg([("memory", 8 * GiB)], engine_blocks=1000)).run(reqs)
    assert sim.totals.engine_tokens == 3 * 1920 and sim.totals.tier_tokens == {"memory": 0}


def test_tiers_too_small_for_a_session_lose_it_and_promotion_refills_memory():
    reqs = _reqs(w1(4, 2048, vocab=1000))
    session = 2048 * MODEL.bytes_per_token + 8 * 4096
    # Memory holds one session, disk all four: resumes come from disk, and
    # each resume is promoted into memory.
    sim = Simulator(_cfg([("memory", session + 8192), ("disk", 8 * GiB)])).run(reqs)
    assert sim.totals.tier_tokens == {"memory": 0, "disk": 4 * 1920}
    mem = sim.instances[0].store.tiers[0][1]
    assert sim.written_bytes()["disk"] == 4 * session
    assert mem.evictions > 0 and mem.used <= mem.capacity


def test_ttft_follows_the_prefill_law_and_loads():
    pf = PrefillModel(1e-3, 1e-7, 0.01, "test")
    reqs = _reqs(w1(2, 1024, vocab=1000))
    for i, r in enumerate(reqs):
        r.t = 100.0 * i  # one at a time: no queueing
    sim = Simulator(_cfg([("memory", GiB)], prefill=pf, copy_gbps=1e9, engine_blocks=9), keep_outcomes=True).run(reqs)
    warm, resume = sim.outcomes[:2], sim.outcomes[2:]
    for o in warm:
        assert o.ttft_s == pf.seconds(1024)
    nbytes = 896 * MODEL.bytes_per_token
    for o in resume:
        assert o.tier_tokens == {"memory": 896}
        load = DEFAULT_IO["memory"].seconds(nbytes)
        assert abs(o.ttft_s - (pf.seconds(1024, 896) + load)) < 1e-4
        assert o.baseline_ttft_s == pf.seconds(1024)
    # Sent together, the second waits for the first.
    for r in reqs:
        r.t = 0.0
    sim = Simulator(_cfg([("memory", GiB)], prefill=pf), keep_outcomes=True).run(reqs[:2])
    assert sim.outcomes[1].ttft_s == sim.outcomes[0].ttft_s + pf.seconds(1024)


def test_multi_turn_chat_hits_the_history_and_every_token_is_accounted_for():
    reqs = _reqs(w2(ChatShape(sessions=6, turns=(3, 4), concurrency=2), vocab=1000, seed=2))
    sim = Simulator(_cfg([("memory", GiB)], engine_blocks=12), keep_outcomes=True).run(reqs)
    for o, r in zip(sim.outcomes, reqs):
        cached = o.engine_tokens + sum(o.tier_tokens.values())
        assert cached <= (r.prompt_tokens - 1) // 128 * 128
    later = [o for o, r in zip(sim.outcomes, reqs) if r.turn > 0]
    assert sum(sum(o.tier_tokens.values()) + o.engine_tokens for o in later) > 0.5 * sum(o.prompt_tokens for o in later)


def test_sticky_routing_keeps_sessions_on_one_instance_random_does_not():
    reqs = _reqs(w2(ChatShape(sessions=20, turns=(3, 3)), vocab=1000, seed=1))
    sticky = Simulator(_cfg([("memory", GiB)], instances=4, routing="sticky"), keep_outcomes=True).run(reqs)
    rand = Simulator(_cfg([("memory", GiB)], instances=4, routing="random"), keep_outcomes=True).run(reqs)
    by = {}
    for o, r in zip(sticky.outcomes, reqs):
        by.setdefault(r.session, set()).add(o.instance)
    assert all(len(v) == 1 for v in by.values()) and len({i for v in by.values() for i in v}) > 1
    hits = lambda s: s.totals.engine_tokens + sum(s.totals.tier_tokens.values())
    assert hits(sticky) > hits(rand)
    # A shared tier serves what a random router sends elsewhere.
    shared = Simulator(_cfg([("memory", GiB), ("shared", 8 * GiB)], instances=4, routing="random")).run(reqs)
    assert hits(shared) > hits(rand) and shared.totals.tier_tokens["shared"] > 0


def test_a_chat_log_hashed_per_chunk_replays_like_one_hashed_per_engine_block():
    """A log with one id per 256 tokens lacks the ids of each prompt's last
    128-token block, which kvtier stores (and the next turn hits); the loader
    recovers them from the next turn, so both logs give the same hits."""
    wl = w2(ChatShape(sessions=8, turns=(3, 5), concurrency=2), vocab=1000, seed=4)
    fine, coarse = _reqs(wl, 128), _reqs(wl, 256)
    # Every turn but a session's last has all its units back (the last has
    # no next turn to learn from). Ids differ between the logs; sharing does not.
    last = {}
    for r in fine:
        last[r.session] = max(last.get(r.session, 0), r.turn)
    for c, f in zip(sorted(coarse, key=lambda r: r.id), sorted(fine, key=lambda r: r.id)):
        assert len(c.units) == len(f.units) or c.turn == last[c.session]
    a = Simulator(_cfg([("memory", GiB), ("disk", GiB)], engine_blocks=12)).run(fine).totals
    b = Simulator(_cfg([("memory", GiB), ("disk", GiB)], engine_blocks=12)).run(coarse).totals
    assert a.tier_tokens == b.tier_tokens and a.engine_tokens == b.engine_tokens
    assert a.tier_tokens["memory"] > 0


def test_a_running_request_keeps_its_engine_blocks_until_it_finishes():
    from kvtier.plan.models import EngineModel

    def replay(a_finish):
        e = EngineModel(12)
        a, b = [1, 2, 3, 4], [11, 12, 13, 14, 15, 16, 17, 18]
        e.release(0.0)
        e.run([], a, 5, a_finish)   # A: 4 full blocks and a partial one
        e.release(1.0)
        e.run([], b, 9, 5.0)        # B starts while A runs
        e.release(11.0)
        return e.match(a, 4)        # A's next turn

    assert replay(10.0) == 4  # held while running, then the most recent in the free queue
    assert replay(None) == 3  # freed at once: B's allocation evicts A's tail block
