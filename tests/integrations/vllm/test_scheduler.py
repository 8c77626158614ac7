"""The connector's scheduler side, run without an engine: real TieredStore,
plain objects standing in for vLLM's Request / KVCacheBlocks / SchedulerOutput
(only the attributes the scheduler reads). Engine behaviour itself is tested
end to end in test_e2e.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvtier.codec import encode
from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.topology import Topology
from kvtier.keys import Namespace, next_key, root_key

BS, C = 4, 8  # engine block size, chunk tokens
NS = Namespace("m", "fp", "float32", "test", 1, 1, 4, chunk_tokens=C)


@pytest.fixture
def sched():
    cfg = parse_store_config({"tiers": ["memory://?capacity=64MiB"], "chunk_tokens": C})
    s = _scheduler(cfg, TieredStore(cfg))
    yield s
    s.close()


def _scheduler(cfg, store) -> KVTierScheduler:
    """A scheduler whose view looks up in ``store`` (the test fills it)."""
    settings = Settings(cfg, NS, BS, 1, "float32", Topology(1, None))
    s = KVTierScheduler(settings, GroupView(settings, stores=[store]), connector_metrics())
    return s


def request(rid, tokens, prompt=None, salt=None, **kw):
    return SimpleNamespace(
        request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens),
        num_prompt_tokens=len(tokens) if prompt is None else prompt, cache_salt=salt,
        mm_features=kw.get("mm"), lora_request=kw.get("lora"), prompt_embeds=None,
    )


def store_chunks(s, tokens, lengths, salt=""):
    """Put chunks of the given lengths (consecutive) into the store."""
    prev, pos = root_key(NS.with_salt(salt).digest()), 0
    for n in lengths:
        k = next_key(prev, tokens[pos : pos + n])
        s.view.stores[0].put([encode(k, "float32", (1, n // BS, 1, 2 * BS, 4), bytes(n * 32))])
        prev = k if n == C else prev
        pos += n


def ask(s, req, local=0):
    deadline = time.monotonic() + 5
    while True:
        n, is_async = s.get_num_new_matched_tokens(req, local)
        if n is not None or time.monotonic() > deadline:
            return n, is_async


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def output(new=(), cached=None, scheduled=None):
    cached = cached or SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {})


def connector_output(finished=None, invalid=(), failed=()):
    """What vLLM hands update_connector_output after a step."""
    return SimpleNamespace(finished_recving=finished, invalid_block_ids=set(invalid), failed_recving=set(failed))


TOK = list(range(3, 40))


def claim_two_chunks(s, load_async=False):
    """Request "a" (20 tokens) claims the two chunks the store holds, and vLLM
    allocates its blocks: the state from which a load starts."""
    req = request("a", TOK[:20])
    assert ask(s, req) == (16, load_async)
    s.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14]), 16)
    return req


def test_miss_claims_nothing(sched):
    assert ask(sched, request("a", TOK[:20])) == (0, False)


def test_full_chunk_hit_in_memory_is_claimed_sync_and_planned_as_a_load(sched):
    store_chunks(sched, TOK, [C, C])
    claim_two_chunks(sched)  # usable = 16: two full chunks
    meta = sched.build_connector_meta(output())
    (job,) = meta.loads
    assert job.sync  # host memory: copied in before this step's forward
    assert [c.block_ids for c in job.chunks] == [[10, 11], [12, 13]]
    assert [c.skip for c in job.chunks] == [0, 0]
    assert sched.build_connector_meta(output()).loads == []  # handed over once


def test_engine_local_hit_is_not_claimed_again_and_its_blocks_are_skipped(sched):
    store_chunks(sched, TOK, [C, C])
    req = request("a", TOK[:20])
    assert ask(sched, req, local=4) == (12, False)  # vLLM holds block 0 itself
    sched.update_state_after_alloc(req, Blocks([10, 11, 12, 13, 14]), 12)
    (job,) = sched.build_connector_meta(output()).loads
    assert [(c.block_ids, c.skip) for c in job.chunks] == [([10, 11], 1), ([12, 13], 0)]
    assert ask(sched, request("b", TOK[:20]), local=16) == (0, False)


def test_a_partial_tail_stored_by_a_shorter_prompt_is_found(sched):
    store_chunks(sched, TOK, [C, 4])  # chunk 0 full, then a 4-token tail
    assert ask(sched, request("a", TOK[:22])) == (12, False)


def test_a_chunk_running_past_the_usable_end_serves_its_leading_blocks(sched):
    store_chunks(sched, TOK, [C, C, C])
    req = request("a", TOK[:24])  # usable = 20 (one token must be computed)
    assert ask(sched, req) == (20, False)
    sched.update_state_after_alloc(req, Blocks(list(range(20, 26))), 20)
    (job,) = sched.build_connector_meta(output()).loads
    assert [c.block_ids for c in job.chunks] == [[20, 21], [22, 23], [24]]
    assert job.chunks[2].key.num_tokens == C


def test_salt_separates_tenants(sched):
    store_chunks(sched, TOK, [C, C], salt="alice")
    assert ask(sched, request("a", TOK[:20], salt="bob")) == (0, False)
    assert ask(sched, request("b", TOK[:20], salt="alice")) == (16, False)
    assert ask(sched, request("c", TOK[:20])) == (0, False)


def test_multimodal_and_lora_requests_bypass_kvtier(sched):
    store_chunks(sched, TOK, [C, C])
    assert ask(sched, request("a", TOK[:20], mm=[object()])) == (0, False)
    assert ask(sched, request("b", TOK[:20], lora=object())) == (0, False)


def test_a_request_that_must_compute_its_prompt_is_never_claimed(sched):
    """Prompt logprobs need every prompt position computed: vLLM 0.31+ marks
    such requests ``skip_reading_prefix_cache``; vLLM 0.30 does not (only
    the sampling parameters say it) and asks connectors anyway."""
    store_chunks(sched, TOK, [C, C])
    before = sched.metrics.skipped_requests._value.get()
    marked = request("a", TOK[:20])
    marked.skip_reading_prefix_cache = True
    assert ask(sched, marked) == (0, False)
    old = request("b", TOK[:20])  # 0.30: no attribute, prompt logprobs asked for
    old.sampling_params = SimpleNamespace(prompt_logprobs=1)
    assert ask(sched, old) == (0, False)
    assert ask(sched, old) == (0, False)  # asked again: counted once
    assert sched.metrics.skipped_requests._value.get() == before + 2
    plain = request("c", TOK[:20])
    plain.skip_reading_prefix_cache = False
    plain.sampling_params = SimpleNamespace(prompt_logprobs=None)
    assert ask(sched, plain) == (16, False)


def test_saves_full_chunks_as_they_fill_and_the_prompt_tail(sched):
    req = request("a", TOK[:22])  # prompt of 22: chunks [0,8) [8,16), tail [16,20)
    assert ask(sched, req) == (0, False)
    sched.update_state_after_alloc(req, Blocks([]), 0)
    new = SimpleNamespace(req_id="a", block_ids=([5, 6, 7, 8, 9, 10],), num_computed_tokens=0)
    meta = sched.build_connector_meta(output([new], scheduled={"a": 12}))  # chunked prefill: 12 tokens
    (job,) = meta.saves
    assert [(c.key.num_tokens, c.block_ids) for c in job.chunks] == [(8, [5, 6])]
    cached = SimpleNamespace(req_ids=["a"], new_block_ids=[None], num_computed_tokens=[12], resumed_req_ids=set())
    (job,) = sched.build_connector_meta(output(cached=cached, scheduled={"a": 10})).saves
    assert [(c.key.num_tokens, c.block_ids) for c in job.chunks] == [(8, [7, 8]), (4, [9])]
    # The saved chunks are the ones a later lookup computes.
    keys = [c.key for c in meta.saves[0].chunks + job.chunks]
    for k, blocks in zip(keys, ([5, 6], [7, 8], [9])):
        sched.view.stores[0].put([encode(k, "float32", (1, len(blocks), 1, 2 * BS, 4), bytes(k.num_tokens * 32))])
    assert ask(sched, request("b", TOK[:22])) == (20, False)


def test_chunks_already_in_kvtier_are_not_saved_again(sched):
    store_chunks(sched, TOK, [C])
    req = request("a", TOK[:20])
    assert ask(sched, req) == (8, False)
    sched.update_state_after_alloc(req, Blocks([1, 2, 3, 4, 5]), 8)
    new = SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=8)
    (job,) = sched.build_connector_meta(output([new], scheduled={"a": 12})).saves
    assert [c.block_ids for c in job.chunks] == [[3, 4], [5]]


def test_after_a_failed_load_the_request_is_never_claimed_again(sched):
    store_chunks(sched, TOK, [C, C])
    req = claim_two_chunks(sched)
    sched.build_connector_meta(output())
    sched.update_connector_output(connector_output({"a"}, invalid={12}))
    assert ask(sched, req) == (0, False)  # vLLM asks again after a failure: answer 0, or it loops


def test_a_hit_on_disk_is_loaded_asynchronously(tmp_path):
    cfg = parse_store_config({"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}], "chunk_tokens": C})
    store = TieredStore(cfg)
    s = _scheduler(cfg, store)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        claim_two_chunks(s, load_async=True)
        (job,) = s.build_connector_meta(output()).loads
        assert not job.sync and job.tiers == ["disk", "disk"]
    finally:
        s.close()
        store.close()


def test_a_failed_synchronous_load_is_noticed_within_its_step(sched):
    store_chunks(sched, TOK, [C, C])
    claim_two_chunks(sched)
    sched.build_connector_meta(output())
    sched.update_connector_output(connector_output(invalid={13}))
    assert sched._reqs["a"].failed and sched._reqs["a"].saved_upto == 0  # its KV is recomputed: save it again


def test_at_tp2_a_chunk_is_a_hit_only_when_every_ranks_shard_is_there(tmp_path):
    """Rank 0 holds chunks 0-1, rank 1 only chunk 0 (each on its own disk
    folder): the scheduler claims chunk 0 alone, read from the folders it
    does not own."""
    from kvtier.keys import shard_key

    cfg = parse_store_config({"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}],
                              "chunk_tokens": C})
    settings = Settings(cfg, NS, BS, 1, "float32", Topology(2, None))
    writers = [TieredStore(settings.topology.shard_config(cfg, r)) for r in (0, 1)]  # what each rank's worker owns
    s = KVTierScheduler(settings, GroupView(settings), connector_metrics())
    try:
        prev, keys = root_key(NS.digest()), []
        for i in range(2):
            prev = next_key(prev, TOK[i * C : (i + 1) * C])
            keys.append(prev)
        for rank, n in ((0, 2), (1, 1)):
            writers[rank].put([encode(shard_key(k, rank, 2), "float32", (1, C // BS, 1, 2 * BS, 4), bytes(C * 32))
                               for k in keys[:n]])
            assert writers[rank].flush(10)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tp2-rank0", "tp2-rank1"]
        req = request("a", TOK[:20])
        assert ask(s, req) == (8, True)  # chunk 0 only; from disk: asynchronous
    finally:
        s.close()
        for w in writers:
            w.close()


def test_a_failure_reported_before_the_load_finished_still_counts(tmp_path):
    """At TP=2 one rank reports its failed blocks in one step, and vLLM
    reports the load finished a step later, once the other rank is done: the
    request is still marked failed (not claimed again, stored again)."""
    cfg = parse_store_config({"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}], "chunk_tokens": C})
    store = TieredStore(cfg)
    s = _scheduler(cfg, store)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        req = claim_two_chunks(s, load_async=True)
        s.build_connector_meta(output())
        s.update_connector_output(connector_output(invalid={12}))
        s.update_connector_output(connector_output({"a"}))
        assert s._reqs["a"].failed and s._reqs["a"].saved_upto == 0
        assert ask(s, req) == (0, False)
    finally:
        s.close()
        store.close()


def test_the_engine_core_waits_quietly_from_a_loads_step_until_it_ends(tmp_path):
    """enginewait: from the step that hands out a load until vLLM reports it
    done (a synchronous load: its own step's output; an asynchronous one:
    finished_recving), the engine core does not spin for its workers."""
    import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401  (the engine core's queues)

    from kvtier.integrations.vllm import enginewait

    cfg = parse_store_config({"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "64MiB"}], "chunk_tokens": C})
    store = TieredStore(cfg)
    s = _scheduler(cfg, store)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        claim_two_chunks(s, load_async=True)
        assert not enginewait._loading
        assert s.build_connector_meta(output()).loads
        assert enginewait._loading
        s.update_connector_output(connector_output())
        assert enginewait._loading  # still reading
        s.update_connector_output(connector_output({"a"}))
        assert not enginewait._loading
    finally:
        s.close()
        store.close()
    assert not enginewait._loading


def test_a_synchronous_load_holds_the_quiet_for_its_own_step(sched):
    import vllm.distributed.device_communicators.shm_broadcast  # noqa: F401

    from kvtier.integrations.vllm import enginewait

    store_chunks(sched, TOK, [C, C])
    claim_two_chunks(sched)
    sched.build_connector_meta(output())
    assert enginewait._loading
    sched.update_connector_output(connector_output())
    assert not enginewait._loading


def test_a_preempted_requests_second_claim_is_not_counted_as_vllm_does_not(sched):
    """vLLM counts the hits of a request it preempted and runs again apart
    from external_prefix_cache_hits; kvtier's external hit tokens, which
    must sum to it, leave that claim out too (the load still happens)."""
    store_chunks(sched, TOK, [C, C])
    counter = sched.metrics.external_hit_tokens.labels("memory")
    before = counter._value.get()
    req = claim_two_chunks(sched)
    assert counter._value.get() == before + 16
    sched.build_connector_meta(output())
    sched.update_connector_output(connector_output())
    sched.request_finished(req, [])
    again = request("a", TOK[:20])
    again.num_preemptions = 1
    assert ask(sched, again) == (16, False)
    sched.update_state_after_alloc(again, Blocks([20, 21, 22, 23, 24]), 16)
    assert counter._value.get() == before + 16
    (job,) = sched.build_connector_meta(output()).loads  # loaded all the same
    assert [c.block_ids for c in job.chunks] == [[20, 21], [22, 23]]
