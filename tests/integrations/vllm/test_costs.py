"""Load or recompute (costs.py): the rates the scheduler learns and the
claims it makes from them, with a fake clock; and the scheduler claiming a
disk hit short once its loads are known to be slower than prefill."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.metadata import KVTierWorkerMeta
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.settings import Settings, parse_load_decision
from kvtier.integrations.vllm.topology import Topology
from tests.integrations.vllm.test_scheduler import BS, NS, TOK, Blocks, C, ask, output, request, store_chunks


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
    assert c.claimable(["memory", "shared", "shared"]) == (3, None)


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
    assert c.claimable(["memory", "disk", "shared", "shared"]) == (2, "shared")
    assert c.claimable(["disk", "disk"]) == (2, None)


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
    assert c.claimable(tiers, tokens, {}) == (4, None)  # alone it pays off
    # 1024 ahead + 1024 own at 0.5 ms: 1.024 s, as long as recomputing: still claimed.
    assert c.claimable(tiers, tokens, {"shared": 1024}) == (4, None)
    # 2048 ahead: 1.536 s to wait for 1.024 s of prefill: left to the engine.
    assert c.claimable(tiers, tokens, {"shared": 2048}) == (0, "shared")
    assert c.claimable(tiers, tokens, {"disk": 1 << 20}) == (4, None)  # another tier's queue is not in its way
    # Memory chunks are claimed before the queue; the shared ones are judged
    # on their own tokens: (1024 + 512) x 0.5 ms > 512 x 1 ms.
    assert c.claimable(["memory", "shared", "shared"], [256] * 3, {"shared": 1024}) == (1, "shared")
    # The wait ahead is amortized over all of a tier's chunks: 256 ahead
    # would not pay for one chunk ((256 + 256) x 0.5 ms = 256 x 1 ms; 300 is
    # more) but pays for two.
    assert c.claimable(["shared"], [256], {"shared": 300}) == (0, "shared")
    assert c.claimable(["shared", "shared"], [256, 256], {"shared": 300}) == (2, None)
    # With loaded requests waiting for the engine, a recompute holds each of
    # them up for its own prefill: 2048 ahead no longer outweighs it when
    # two requests wait ((2048 + 1024) x 0.5 ms = 1.536 s <= 1024 x 3 x 1 ms),
    # but a small request still does not wait behind large loads.
    assert c.claimable(tiers, tokens, {"shared": 2048}, waiting=2) == (4, None)
    assert c.claimable(["shared"], [64], {"shared": 4096}, waiting=2) == (0, "shared")


def test_a_ruled_out_tier_is_probed_once_per_interval_and_used_again_once_it_recovers():
    c, clock = costs()
    c.prefill.value = 0.001
    c.loaded("shared", seconds=2.56, tokens=256)
    assert c.claimable(["shared", "shared"]) == (0, "shared")
    assert c.ruled_out() == {"shared"}
    assert not c.start_probe("shared")  # measured just now
    clock.now += 30.0
    assert c.start_probe("shared")
    assert not c.start_probe("shared")  # one probe at a time
    for _ in range(8):  # it recovered: 0.1 ms per token now, within a few loads...
        c.loaded("shared", seconds=0.0256, tokens=256)
    assert c.ruled_out() == set()
    assert c.claimable(["shared", "shared"]) == (2, None)  # ...and is used again


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


def _disk_scheduler(path, bytes_per_token=0.0, **decision):
    cfg = parse_store_config({"tiers": [{"kind": "disk", "path": str(path), "capacity": "64MiB"}],
                              "chunk_tokens": C})
    store = TieredStore(cfg)
    settings = replace(Settings(cfg, NS, BS, 1, "float32", Topology(1, None)),
                       decision=parse_load_decision(decision, ["disk"]))
    return KVTierScheduler(settings, GroupView(settings, stores=[store]), connector_metrics(), bytes_per_token), store


def _load_and_time(s, rid, seconds, loaded=None):
    """Claim TOK[:20] for ``rid``, let its load run and report ``seconds`` of
    reading that brought ``loaded`` tokens in (default: all it claimed)."""
    req = request(rid, TOK[:20])
    n, is_async = ask(s, req)
    if n:
        s.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14]), n)
        s.build_connector_meta(output())
        s.update_connector_output(SimpleNamespace(finished_recving={rid}, invalid_block_ids=set(), failed_recving=set(),
                                                  kv_connector_worker_meta=KVTierWorkerMeta(
                                                      {rid: (seconds, n if loaded is None else loaded)})))
    s.request_finished(req, [])
    return n


def test_the_scheduler_stops_claiming_a_tier_whose_loads_are_slower_than_prefill(tmp_path):
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001  # the engine computes a token in 1 ms
        decisions = s.metrics.recompute_decisions
        before = decisions.labels("disk", "not_asked")._value.get()
        assert _load_and_time(s, "a", seconds=1.6) == 16  # rate unknown: claimed; 100 ms per token measured
        assert s.costs.tiers["disk"].value == pytest.approx(0.1)
        assert s.costs.ruled_out() == {"disk"}
        assert _load_and_time(s, "b", seconds=0.001) == 0  # now left to the engine, the tier not even asked
        assert decisions.labels("disk", "not_asked")._value.get() - before == 1
    finally:
        s.close()
        store.close()


def test_a_probe_reads_in_the_background_while_the_request_recomputes(tmp_path):
    s, store = _disk_scheduler(tmp_path, probe_interval_s=0.05)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        assert _load_and_time(s, "a", seconds=1.6) == 16  # 100 ms per token: ruled out
        time.sleep(0.06)  # a probe is due: the request goes on without the tier, the probe reads it
        assert _load_and_time(s, "b", seconds=0.0) == 0
        (tier, fut), = s._probes
        assert tier == "disk" and fut.result(5)[1] == C  # shard 0 of the prompt's first chunk, read for real
        s.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=set(), failed_recving=set()))
        assert s.costs.tiers["disk"].value < 0.1  # the fast read pulled the estimate down
        assert not s._probes
    finally:
        s.close()
        store.close()


def _claim(s, rid, tokens=TOK[:20], blocks=(10, 11, 12, 13, 14)):
    """Ask for ``rid`` and allocate what it claims; the claimed count."""
    req = request(rid, tokens)
    n, _ = ask(s, req)
    if n:
        s.update_state_after_alloc(req, Blocks(list(blocks)), n)
    return n


def test_a_claim_counts_the_loads_queued_ahead_on_its_tier(tmp_path):
    """The disk loads a token in 0.6 ms, the engine computes one in 1 ms: a
    request alone loads its 16 tokens. A second one with another 16 pending
    ahead of it would wait 19.2 ms for 16 ms of prefill; with a third load
    of 16 ahead, 28.8 ms. Recomputing it would hold up the loaded requests
    waiting for the engine: 16 ms each, so b (one waiting: 32 ms) is loaded,
    and so is c (two waiting: 48 ms). Without loads waiting for the engine
    nothing holds a recompute back: a load that would wait 1.2 s behind a
    large queue is left to the engine."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        s.costs.loaded("disk", seconds=0.0096, tokens=16)
        queued = s.metrics.recompute_decisions.labels("disk", "queued")
        before = queued._value.get()
        assert _claim(s, "a") == 16
        assert _claim(s, "b") == 16
        assert _claim(s, "c") == 16
        assert queued._value.get() == before
        # Only c's tier queue, no loaded request waiting for the engine: a
        # queue of 2000 tokens (1.2 s) outweighs 16 ms of prefill.
        assert s.costs.claimable(["disk"], [16], {"disk": 2000}, waiting=0) == (0, "disk")
    finally:
        s.close()
        store.close()


def test_an_asynchronous_load_carries_its_budget_and_the_prefill_rate(tmp_path):
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        assert _claim(s, "a") == 16
        (job,) = s.build_connector_meta(output()).loads
        assert job.budget_s == pytest.approx(0.1 * 16 * 0.001)  # the disk's rate is not known yet
        assert job.prefill_s_per_token == 0.001
    finally:
        s.close()
        store.close()
    s, store = _disk_scheduler(tmp_path / "b", load_decision="always")
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        assert _claim(s, "a") == 16
        (job,) = s.build_connector_meta(output()).loads
        assert job.budget_s is None and job.prefill_s_per_token is None  # "always" loads all, however slowly
    finally:
        s.close()
        store.close()


def test_a_load_stopped_at_its_budget_rules_its_tier_out_and_is_not_saved_again(tmp_path):
    """The first load from a tier not measured yet is stopped with nothing
    in: the tier is ruled out at once (the next request does not ask it),
    the stop is counted, and the request's chunks, stored, are not written
    again while the engine recomputes them."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        stopped = s.metrics.stopped_loads.labels("disk", "budget")
        before = stopped._value.get()
        waits = REGISTRY.get_sample_value("kvtier_vllm_load_wait_seconds_count") or 0.0
        assert _claim(s, "a") == 16
        s.build_connector_meta(output())
        s.update_connector_output(SimpleNamespace(
            finished_recving={"a"}, invalid_block_ids={10, 11, 12, 13}, failed_recving=set(),
            kv_connector_worker_meta=KVTierWorkerMeta({"a": (0.0016, 0)}, {"a": "budget"})))
        assert stopped._value.get() - before == 1
        assert REGISTRY.get_sample_value("kvtier_vllm_load_wait_seconds_count") - waits == 1  # what "a" waited
        assert s.costs.ruled_out() == {"disk"}
        assert ask(s, request("a", TOK[:20])) == (0, False)
        cached = SimpleNamespace(req_ids=["a"], new_block_ids=[None], num_computed_tokens=[0], resumed_req_ids=set())
        assert s.build_connector_meta(output(cached=cached, scheduled={"a": 20})).saves == []
        assert _claim(s, "b") == 0
    finally:
        s.close()
        store.close()


def test_a_load_cut_short_counts_only_what_arrived(tmp_path):
    """A tier so slow that the load ran into its deadline with one chunk of
    two in: 1 s for 8 tokens is slower than prefill, although 1 s for the 16
    claimed would not be."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.1
        assert _load_and_time(s, "a", seconds=1.0, loaded=8) == 16
        assert s.costs.tiers["disk"].value == pytest.approx(1.0 / 8)
        assert _load_and_time(s, "b", seconds=0.0) == 0
    finally:
        s.close()
        store.close()


def test_always_claims_whatever_the_rates_and_a_seed_rules_out_before_any_load(tmp_path):
    s, store = _disk_scheduler(tmp_path, load_decision="always")
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        s.costs.loaded("disk", 1.6, 16)
        assert _load_and_time(s, "a", seconds=1.6) == 16
    finally:
        s.close()
        store.close()
    # A seed: 1 byte per second from disk, the engine at 1000 tokens per second.
    s, store = _disk_scheduler(tmp_path / "b", bytes_per_token=32, read_rates={"disk": "1B"}, prefill_tokens_per_s=1000)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        assert _load_and_time(s, "a", seconds=0.0) == 0
    finally:
        s.close()
        store.close()


def test_a_saved_chunk_is_read_back_to_measure_a_tier_before_any_resume(tmp_path):
    """A fresh engine knows no tier's rate. Its first save starts a read-back
    probe on each persistent tier not measured: the probe waits until the
    write-through stored the chunk, reads it, and the rate is known before
    any request would have to load from the tier (only one probe at a time)."""
    from kvtier.codec import encode
    from tests.integrations.vllm.test_scheduler import output

    s, store = _disk_scheduler(tmp_path)
    try:
        req = request("a", TOK[:22])
        assert ask(s, req) == (0, False)
        s.update_state_after_alloc(req, Blocks([]), 0)
        new = SimpleNamespace(req_id="a", block_ids=([5, 6, 7, 8, 9, 10],), num_computed_tokens=0)
        (job,) = s.build_connector_meta(output([new], scheduled={"a": 22})).saves
        assert [t for t, _ in s._probes] == ["disk"]
        s.build_connector_meta(output([new], scheduled={"a": 22}))  # another save: still one probe
        assert len(s._probes) == 1
        time.sleep(0.25)  # the probe looks for the chunk, not stored yet
        assert not s._probes[0][1].done()
        key = job.chunks[0].key  # the worker's write-through lands
        store.put([encode(key, "float32", (1, key.num_tokens // BS, 1, 2 * BS, 4), bytes(key.num_tokens * 32))])
        store.flush()
        s._probes[0][1].result(5)
        assert not s.costs.measured("disk")
        s.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=set(), failed_recving=set()))
        assert s.costs.measured("disk") and s.costs.tiers["disk"].value > 0
        assert not s._probes
    finally:
        s.close()
        store.close()


def test_a_request_whose_every_tier_is_ruled_out_is_answered_at_once(tmp_path):
    """With its only persistent tier ruled out there is nothing to look up
    but host memory: the answer comes within the call, never from the lookup
    pool (where it would cost the request a deferred engine step)."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        s.costs.loaded("disk", seconds=1.6, tokens=16)  # 100 ms per token: ruled out
        s._lookups.submit = lambda *a, **k: pytest.fail("a lookup with nothing to ask went to the lookup pool")
        deferred = s.metrics.lookup_deferred._value.get()
        assert s.get_num_new_matched_tokens(request("a", TOK[:20]), 0) == (0, False)
        assert s.metrics.lookup_deferred._value.get() == deferred
    finally:
        s.close()
        store.close()


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


def test_the_scheduler_paces_loads_in_flight_together(tmp_path):
    """Two requests loading at once, each with 4 tokens left to compute at
    1 ms a token against a 1.5 ms step: one is handed over per step. With
    one load in flight, or a step costing more than half a suffix, all at
    once."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value, s.costs.step.value = 0.001, 0.0015
        s.costs.loaded("disk", seconds=0.00001, tokens=16)
        assert _claim(s, "a") == 16  # 20 tokens, 16 claimed: 4 to compute
        assert s.build_connector_meta(output()).release == 0  # one load
        assert _claim(s, "b") == 16
        assert s.build_connector_meta(output()).release == 1
        s.costs.step.value = 0.010
        assert s.build_connector_meta(output()).release == 0
    finally:
        s.close()
        store.close()


def test_nothing_is_saved_while_every_tier_is_too_slow_to_load_from(tmp_path):
    """The only tier is ruled out and there is no host memory: a request's
    chunks are not written to a tier that cannot serve them with profit
    (the writes would only load it further); once it is fast again they are."""
    s, store = _disk_scheduler(tmp_path)
    try:
        s.costs.prefill.value = 0.001
        s.costs.loaded("disk", seconds=1.6, tokens=16)  # ruled out
        req = request("a", TOK[:22])
        assert ask(s, req) == (0, False)
        s.update_state_after_alloc(req, Blocks([]), 0)
        new = SimpleNamespace(req_id="a", block_ids=([5, 6, 7, 8, 9, 10],), num_computed_tokens=0)
        assert s.build_connector_meta(output([new], scheduled={"a": 22})).saves == []
        s.costs.tiers["disk"].value = 0.00001  # recovered
        cached = SimpleNamespace(req_ids=["a"], new_block_ids=[None], num_computed_tokens=[22], resumed_req_ids=set())
        (job,) = s.build_connector_meta(output(cached=cached, scheduled={"a": 0})).saves
        assert [c.key.num_tokens for c in job.chunks] == [C, C, 4]
    finally:
        s.close()
        store.close()


def test_a_claim_weighs_the_load_queue_against_the_engines_own_backlog(tmp_path):
    """The disk loads a token in 0.6 ms, the engine computes one in 1 ms.
    Behind 16 tokens of loads, 16 more would wait 19.2 ms for 16 ms of
    prefill: alone, that is a recompute. But with a request ahead that the
    engine must compute from scratch (30 prompt tokens, a miss), a
    recompute waits for it too: 46 ms against the load's 19.2, so the
    load pays off."""
    s, store = _disk_scheduler(tmp_path)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        s.costs.loaded("disk", seconds=0.0096, tokens=16)
        miss = request("m", [7] * 30)
        miss.num_computed_tokens = 0
        assert ask(s, miss) == (0, False)  # answered first: in the engine's queue, all 30 tokens to compute
        assert _claim(s, "a") == 16
        assert _claim(s, "b") == 16
    finally:
        s.close()
        store.close()
