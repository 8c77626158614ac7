"""The scheduler's claims under ``load_decision`` (claims.py, on the cost
model of costs.py): a hit claimed only as far as loading it beats
recomputing it, behind the loads queued on its tier and the engine's own
backlog; loads paced when they end together; nothing saved where nothing
could be loaded with profit."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.metadata import KVTierWorkerMeta
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.settings import Settings, parse_load_decision
from kvtier.integrations.vllm.topology import Topology
from tests.integrations.vllm.test_scheduler import BS, NS, TOK, Blocks, C, ask, output, request, store_chunks


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
        assert s.costs.claimable(["disk"], [16], {"disk": 2000}, 0, 0) == (0, "disk")
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
