"""The connector's Prometheus metrics, beside the store's (``kvtier.metrics``).

prometheus_client registers a metric once per process, and vLLM may build
two connectors in one process (scheduler and worker roles, when they share
it), so the instruments are made once per process here and every connector
of the process uses them. They hold no state of their own beyond counts.
Under ``vllm serve`` with ``PROMETHEUS_MULTIPROC_DIR`` set (``kvtier serve``
does), the API server merges every process's samples on its ``/metrics``.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvtier.metrics import Metrics

# Per-step work on the engine or scheduler thread: 0.1 ms to 1 s.
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class ConnectorMetrics:
    def __init__(self, registry=REGISTRY):
        self.store = Metrics(registry)
        self.external_hit_tokens = Counter(
            "kvtier_vllm_external_hit_tokens",
            "Tokens kvtier promised vLLM at admission (vLLM counts the same in external_prefix_cache_hits), by the "
            "slowest tier that held one of their shards at lookup; failed loads are in kvtier_vllm_load_failed_blocks",
            ["tier"], registry=registry)
        self.load_failed_blocks = Counter(
            "kvtier_vllm_load_failed_blocks",
            "Engine blocks kvtier promised but could not load; vLLM recomputed them", registry=registry)
        self.load_seconds = Histogram(
            "kvtier_vllm_load_seconds",
            "Time to read a request's chunks (loader thread, before the copy into the engine)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)
        self.load_busy_seconds = Counter(
            "kvtier_vllm_load_busy_seconds",
            "Seconds during which at least one asynchronous load was queued or reading (with kvtier_read_bytes: "
            "the aggregate read rate of loads that overlap, as when many sessions return at once)",
            registry=registry)
        self.load_wait_seconds = Histogram(
            "kvtier_vllm_load_wait_seconds",
            "Time a request waited for its asynchronous load: from the step that handed it to the workers to the "
            "step that reported it done (scheduler)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=registry)
        self.scatter_seconds = Histogram(
            "kvtier_vllm_scatter_seconds",
            "Time spent copying loaded chunks into engine blocks per step (engine thread)",
            buckets=_STEP_BUCKETS, registry=registry)
        self.save_seconds = Histogram(
            "kvtier_vllm_save_seconds",
            "Time spent gathering a step's finished chunks from the engine (in the forward's critical path)",
            buckets=_STEP_BUCKETS, registry=registry)
        self.lookup_seconds = Histogram(
            "kvtier_vllm_lookup_seconds",
            "Time from submitting a request's lookup to its answer (scheduler; host-memory answers included)",
            buckets=_STEP_BUCKETS, registry=registry)
        self.lookup_deferred = Counter(
            "kvtier_vllm_lookup_deferred",
            "Scheduler steps a request waited for its lookup (each costs the request one engine step)",
            registry=registry)
        self.assembled_chunks = Counter(
            "kvtier_vllm_assembled_chunks",
            "Chunk shards this engine cut from shards another TP size wrote (then stored as its own)",
            registry=registry)
        self.skipped_requests = Counter(
            "kvtier_vllm_skipped_requests",
            "Requests kvtier offered no hit because they must compute their whole prompt (prompt logprobs, "
            "skip_reading_prefix_cache)", registry=registry)
        self.recompute_decisions = Counter(
            "kvtier_vllm_recompute_decisions",
            "Requests left to the engine, in part or whole, because loading from TIER is slower than the engine "
            "recomputes (load_decision: auto): reason=cut (a hit claimed short), queued (claimed short because of "
            "the loads queued on the tier), not_asked (the lookup left the tier out)", ["tier", "reason"],
            registry=registry)
        self.stopped_loads = Counter(
            "kvtier_vllm_stopped_loads",
            "Asynchronous loads stopped before they were done, the rest left to the engine (load_decision: auto): "
            "reason=budget (read past their budget), projected (the chunks that arrived showed the rest would "
            "read slower than the engine recomputes it)", ["tier", "reason"], registry=registry)
        self.recomputed_hit_tokens = Counter(
            "kvtier_vllm_recomputed_hit_tokens",
            "Tokens kvtier held but left to the engine to recompute, because loading them from TIER is slower",
            ["tier"], registry=registry)
        self.load_seconds_per_token = Gauge(
            "kvtier_vllm_load_seconds_per_token",
            "The scheduler's running estimate of a tier's load time per token (workers' read times)", ["tier"],
            multiprocess_mode="mostrecent", registry=registry)
        self.prefill_seconds_per_token = Gauge(
            "kvtier_vllm_prefill_seconds_per_token",
            "The scheduler's running estimate of the engine's prefill time per token (its own steps)",
            multiprocess_mode="mostrecent", registry=registry)
        self.saved_chunks = Counter(
            "kvtier_vllm_saved_chunks", "Chunk shards gathered from the engine and handed to the store",
            registry=registry)
        self.events = Counter(
            "kvtier_vllm_kv_events",
            "KV events kvtier handed to vLLM's publisher (--kv-events-config), per tier: kind=stored "
            "(BlockStored: every rank's shard of a chunk entered the tier), removed (BlockRemoved)",
            ["tier", "kind"], registry=registry)
        self.events_dropped = Counter(
            "kvtier_vllm_kv_events_dropped",
            "KV events kvtier could not publish: reason=no_block_hashes (vLLM hashed no blocks for the "
            "request: prefix caching off), worker_backlog (a worker heard more between two steps than it holds)",
            ["reason"], registry=registry)


_lock = threading.Lock()
_instance: ConnectorMetrics | None = None


def connector_metrics() -> ConnectorMetrics:
    """This process's instruments, on prometheus_client's default registry."""
    global _instance
    with _lock:
        if _instance is None:
            _instance = ConnectorMetrics()
        return _instance
