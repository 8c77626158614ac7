"""What the scheduler learns of its tiers' read rates (probes.py): from
its loads, what arrived counting; from a read-back after a save, before
any resume; from a background probe of a tier ruled out, while the request
recomputes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.integrations.vllm.test_claims import _disk_scheduler, _load_and_time
from tests.integrations.vllm.test_scheduler import BS, TOK, Blocks, C, ask, output, request, store_chunks


def test_a_probe_reads_in_the_background_while_the_request_recomputes(tmp_path):
    s, store = _disk_scheduler(tmp_path, probe_interval_s=0.05)
    try:
        store_chunks(s, TOK, [C, C])
        store.flush()
        s.costs.prefill.value = 0.001
        assert _load_and_time(s, "a", seconds=1.6) == 16  # 100 ms per token: ruled out
        time.sleep(0.06)  # a probe is due: the request goes on without the tier, the probe reads it
        assert _load_and_time(s, "b", seconds=0.0) == 0
        (tier, fut), = s.probes.running
        assert tier == "disk" and fut.result(5)[1] == C  # shard 0 of the prompt's first chunk, read for real
        s.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=set(), failed_recving=set()))
        assert s.costs.tiers["disk"].value < 0.1  # the fast read pulled the estimate down
        assert not s.probes.running
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


def test_a_saved_chunk_is_read_back_to_measure_a_tier_before_any_resume(tmp_path):
    """A fresh engine knows no tier's rate. Its first save starts a read-back
    probe on each persistent tier not measured: the probe waits until the
    write-through stored the chunk, reads it, and the rate is known before
    any request would have to load from the tier (only one probe at a time)."""
    from kvtier.codec import encode

    s, store = _disk_scheduler(tmp_path)
    try:
        req = request("a", TOK[:22])
        assert ask(s, req) == (0, False)
        s.update_state_after_alloc(req, Blocks([]), 0)
        new = SimpleNamespace(req_id="a", block_ids=([5, 6, 7, 8, 9, 10],), num_computed_tokens=0)
        (job,) = s.build_connector_meta(output([new], scheduled={"a": 22})).saves
        assert [t for t, _ in s.probes.running] == ["disk"]
        s.build_connector_meta(output([new], scheduled={"a": 22}))  # another save: still one probe
        assert len(s.probes.running) == 1
        time.sleep(0.25)  # the probe looks for the chunk, not stored yet
        assert not s.probes.running[0][1].done()
        key = job.chunks[0].key  # the worker's write-through lands
        store.put([encode(key, "float32", (1, key.num_tokens // BS, 1, 2 * BS, 4), bytes(key.num_tokens * 32))])
        store.flush()
        s.probes.running[0][1].result(5)
        assert not s.costs.measured("disk")
        s.update_connector_output(SimpleNamespace(finished_recving=None, invalid_block_ids=set(), failed_recving=set()))
        assert s.costs.measured("disk") and s.costs.tiers["disk"].value > 0
        assert not s.probes.running
    finally:
        s.close()
        store.close()
