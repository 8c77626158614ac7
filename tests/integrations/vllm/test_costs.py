"""Load or recompute (costs.py): the rates the cost model learns and the
decisions it makes from them, with a fake clock. The scheduler applying
them is tested in test_claims.py and test_probes.py."""

from __future__ import annotations

import pytest

from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.metadata import KVTierWorkerMeta


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def costs(**kw) -> tuple[LoadCosts, Clock]:
    clock = Clock()
    c = LoadCosts(frozenset({"memory"}), min_step_tokens=256, probe_interval_s=30.0, clock=clock, **kw)
    c.step_done(c.step_scheduled(1))  # the engine's first forward: never measured
    return c, clock


def alone(c: LoadCosts, tiers: list[str]) -> tuple[int, str | None]:
    """``claimable`` for a hit of ``tiers``, nothing queued ahead of it."""
    return c.claimable(tiers, [256] * len(tiers), {}, 0, 0)


def test_the_engines_first_forward_is_not_measured():
    clock = Clock()
    c = LoadCosts(frozenset({"memory"}), min_step_tokens=256, clock=clock)
    c.step_done(c.step_scheduled(0))  # waiting for loads: computes nothing
    first = c.step_scheduled(600)
    clock.now += 1.9  # kernels built, memory first touched
    c.step_done(first)
    assert c.prefill.value is None
    second = c.step_scheduled(256)
    clock.now += 0.01
    c.step_done(second)
    assert c.prefill.value == pytest.approx(0.01 / 256)


def test_unknown_rates_claim_everything():
    c, _ = costs()
    assert alone(c, ["memory", "shared", "shared"]) == (3, None)


def test_prefill_rate_comes_from_steps_of_prefill_work_only():
    c, clock = costs()
    c.step_scheduled(1024)
    clock.now += 2.0  # 1024 tokens in 2 s
    c.step_done()
    clock.now += 5.0  # the engine idles between requests: not prefill
    c.step_scheduled(4)  # a decode step...
    clock.now += 1.0  # ...that took 1 s says nothing about prefill
    c.step_done()
    assert c.prefill.value == pytest.approx(2.0 / 1024)


def test_a_step_scheduled_ahead_starts_when_the_one_before_it_ends():
    c, clock = costs()
    c.step_scheduled(512)  # vLLM's async scheduling: two steps in flight
    c.step_scheduled(512)
    clock.now += 1.0
    c.step_done()  # the first: 1 s
    clock.now += 1.0
    c.step_done()  # the second ran after it: 1 s, not 2
    assert c.prefill.value == pytest.approx(1.0 / 512)


def test_steps_are_timed_by_their_own_output_when_one_never_reports():
    """vLLM hands no output for a step that ran no forward and had nothing
    to report: the next output must be timed against its own step, not
    paired with the silent one (which read a prefill as a decode step)."""
    c, clock = costs()
    idle = c.step_scheduled(0)  # waits for loads; its output never comes
    clock.now += 0.01
    prefill = c.step_scheduled(1024)
    clock.now += 1.024
    c.step_done(prefill)
    decode = c.step_scheduled(8)
    clock.now += 0.05
    c.step_done(decode)
    assert idle < prefill < decode
    assert c.prefill.value == pytest.approx(0.001) and c.step.value == pytest.approx(0.05)
    c.step_done(idle)  # a number already passed: nothing to time
    assert c.prefill.value == pytest.approx(0.001) and c.step.value == pytest.approx(0.05)


def test_workers_send_the_step_number_every_step_and_ranks_agree():
    from kvtier.integrations.vllm.metadata import KVTierWorkerMeta
    a, b = KVTierWorkerMeta({"r": (0.5, 256)}, {}, 7), KVTierWorkerMeta({"r": (0.7, 128)}, {"r": "budget"}, 7)
    merged = a.aggregate(b)
    assert merged.step == 7 and merged.reads == {"r": (0.7, 128)} and merged.stopped == {"r": "budget"}


def test_a_tier_slower_than_prefill_cuts_the_claim_at_its_first_chunk():
    c, clock = costs()
    c.prefill.value = 0.001  # 1 ms per token computed
    c.loaded("shared", seconds=2.56, tokens=256)  # 10 ms per token loaded
    c.loaded("disk", seconds=0.0256, tokens=256)  # 0.1 ms
    c.loaded("memory", seconds=99.0, tokens=1)  # host memory is never ruled out
    assert alone(c, ["memory", "disk", "shared", "shared"]) == (2, "shared")
    assert alone(c, ["disk", "disk"]) == (2, None)


def test_a_load_budget_is_its_expected_time_with_a_bounded_margin_over_recompute():
    c, _ = costs()
    assert c.budget("shared", 1000) is None  # prefill not measured: nothing to bound a load by
    c.prefill.value = 0.001  # recomputing 1000 tokens: 1 s
    # Rate unknown: a tenth of recomputing, so a load that brings nothing
    # costs its request 1.1 x recompute.
    assert c.budget("shared", 1000) == pytest.approx(0.1)
    c.loaded("disk", seconds=0.01, tokens=1000)  # 10 ms expected: 2 x that is within the floor
    assert c.budget("disk", 1000) == pytest.approx(0.1)
    c.loaded("nfs", seconds=0.15, tokens=1000)  # 150 ms expected: 2 x that passes expected + 100 ms
    assert c.budget("nfs", 1000) == pytest.approx(0.25)
    c.loaded("s3", seconds=0.06, tokens=1000)  # 60 ms expected: 2 x that, 120 ms
    assert c.budget("s3", 1000) == pytest.approx(0.12)
    assert c.budget("memory", 1000) == pytest.approx(0.1)
    # Eight loads read at once (load_threads 8): a load may take 16 x its
    # expected time sharing the tier, still capped at expected + a tenth.
    wide, _ = costs(sharing=8)
    wide.prefill.value = 0.001
    wide.loaded("nfs", seconds=0.03, tokens=1000)
    assert wide.budget("nfs", 1000) == pytest.approx(0.13)
    assert c.budget("nfs", 1000) > 0  # (one at a time, above: 2 x its expected time)


def test_the_claim_waits_behind_the_tokens_queued_on_its_tier():
    c, _ = costs()
    c.prefill.value = 0.001
    c.loaded("shared", seconds=0.128, tokens=256)  # 0.5 ms per token: half of prefill's
    tiers, tokens = ["shared"] * 4, [256] * 4
    assert c.claimable(tiers, tokens, {}, 0, 0) == (4, None)  # alone it pays off
    # 1024 ahead + 1024 own at 0.5 ms: 1.024 s, as long as recomputing: still claimed.
    assert c.claimable(tiers, tokens, {"shared": 1024}, 0, 0) == (4, None)
    # 2048 ahead: 1.536 s to wait for 1.024 s of prefill: left to the engine.
    assert c.claimable(tiers, tokens, {"shared": 2048}, 0, 0) == (0, "shared")
    assert c.claimable(tiers, tokens, {"disk": 1 << 20}, 0, 0) == (4, None)  # another tier's queue is not in its way
    # Memory chunks are claimed before the queue; the shared ones are judged
    # on their own tokens: (1024 + 512) x 0.5 ms > 512 x 1 ms.
    assert c.claimable(["memory", "shared", "shared"], [256] * 3, {"shared": 1024}, 0, 0) == (1, "shared")
    # The wait ahead is amortized over all of a tier's chunks: 256 ahead
    # would not pay for one chunk ((256 + 256) x 0.5 ms = 256 x 1 ms; 300 is
    # more) but pays for two.
    assert c.claimable(["shared"], [256], {"shared": 300}, 0, 0) == (0, "shared")
    assert c.claimable(["shared", "shared"], [256, 256], {"shared": 300}, 0, 0) == (2, None)
    # With loaded requests waiting for the engine, a recompute holds each of
    # them up for its own prefill: 2048 ahead no longer outweighs it when
    # two requests wait ((2048 + 1024) x 0.5 ms = 1.536 s <= 1024 x 3 x 1 ms),
    # but a small request still does not wait behind large loads.
    assert c.claimable(tiers, tokens, {"shared": 2048}, 0, waiting=2) == (4, None)
    assert c.claimable(["shared"], [64], {"shared": 4096}, 0, waiting=2) == (0, "shared")


def test_a_ruled_out_tier_is_probed_once_per_interval_and_used_again_once_it_recovers():
    c, clock = costs()
    c.prefill.value = 0.001
    c.loaded("shared", seconds=2.56, tokens=256)
    assert alone(c, ["shared", "shared"]) == (0, "shared")
    assert c.ruled_out() == {"shared"}
    assert not c.start_probe("shared")  # measured just now
    clock.now += 30.0
    assert c.start_probe("shared")
    assert not c.start_probe("shared")  # one probe at a time
    for _ in range(8):  # it recovered: 0.1 ms per token now, within a few loads...
        c.loaded("shared", seconds=0.0256, tokens=256)
    assert c.ruled_out() == set()
    assert alone(c, ["shared", "shared"]) == (2, None)  # ...and is used again


def test_a_probe_that_never_reports_lapses():
    c, clock = costs()
    c.prefill.value = 0.001
    c.loaded("shared", seconds=2.56, tokens=256)
    clock.now += 30.0
    assert c.start_probe("shared")
    clock.now += 29.0
    assert not c.start_probe("shared")
    clock.now += 1.0
    assert c.start_probe("shared")


def test_worker_reads_aggregate_to_the_slowest_rank_and_the_fewest_tokens():
    a = KVTierWorkerMeta({"r1": (0.5, 256), "r2": (0.1, 512)})
    b = KVTierWorkerMeta({"r1": (0.2, 128), "r3": (0.3, 256)}, {"r3": "budget"})
    assert a.aggregate(b).reads == {"r1": (0.5, 128), "r2": (0.1, 512), "r3": (0.3, 256)}
    assert a.aggregate(b).stopped == {"r3": "budget"}  # one rank's stop is the load's


def test_loads_are_paced_where_a_suffix_costs_more_than_a_step():
    c, clock = costs()
    assert not c.pace_loads(128)  # nothing measured
    c.step_scheduled(1024)
    clock.now += 1.024
    c.step_done()  # prefill: 1 ms a token
    c.step_scheduled(8)
    clock.now += 0.05
    c.step_done()  # a decode step of 8 requests: 50 ms
    assert c.prefill.value == pytest.approx(0.001) and c.step.value == pytest.approx(0.05)
    assert c.pace_loads(128)  # a suffix of 128 tokens: 128 ms, more than two steps
    assert not c.pace_loads(64)  # 64 ms: under two steps, all at once is better
    c.step_scheduled(64)
    clock.now += 0.128
    c.step_done()  # neither prefill work nor decode: it says nothing of either rate
    assert c.prefill.value == pytest.approx(0.001) and c.step.value == pytest.approx(0.05)
    # A GPU-like engine: a step costs 10 ms whatever it holds, a token 20 us.
    g, _ = costs()
    g.prefill.value, g.step.value = 20e-6, 0.010
    assert not g.pace_loads(128)
