"""State shared by the connector's two roles inside one process.

vLLM builds a scheduler-side and a worker-side connector. With one worker per
engine (tensor parallel 1, vLLM's uniproc executor) both live in the engine
core process and share one TieredStore here, so the scheduler's lookups see
the worker's memory tier, and a prefetch started at lookup feeds the load.
Across processes (tensor parallel > 1) each process has its own store; see
docs/vllm.md for what that means.
"""

from __future__ import annotations

import atexit
import threading

from prometheus_client import REGISTRY, Counter, Histogram

from kvtier.config import StoreConfig
from kvtier.engine.store import Prefetch, TieredStore
from kvtier.metrics import Metrics

_lock = threading.Lock()
_stores: dict[StoreConfig, list] = {}  # config -> [store, refs]
_prefetches: dict[str, Prefetch] = {}
_metrics: Metrics | None = None
_connector_counters: dict = {}
# Per-step work on the engine or scheduler thread: 0.1 ms to 1 s.
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


def metrics() -> Metrics:
    """kvtier's metrics for this process, on prometheus_client's default
    registry, so that a Prometheus endpoint of the process shows them."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = Metrics(REGISTRY)
            _connector_counters["external_hit_tokens"] = Counter(
                "kvtier_vllm_external_hit_tokens",
                "Tokens kvtier promised vLLM at admission (vLLM counts the same in external_prefix_cache_hits), by the tier that held them at lookup; failed loads are in kvtier_vllm_load_failed_blocks",
                ["tier"],
                registry=REGISTRY,
            )
            _connector_counters["load_failed_blocks"] = Counter(
                "kvtier_vllm_load_failed_blocks",
                "Engine blocks kvtier promised but could not load; vLLM recomputed them",
                registry=REGISTRY,
            )
            _connector_counters["load_seconds"] = Histogram(
                "kvtier_vllm_load_seconds",
                "Time to read a request's chunks (loader thread, before the copy into the engine)",
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                registry=REGISTRY,
            )
            _connector_counters["scatter_seconds"] = Histogram(
                "kvtier_vllm_scatter_seconds",
                "Time spent copying loaded chunks into engine blocks per step (engine thread)",
                buckets=_STEP_BUCKETS,
                registry=REGISTRY,
            )
            _connector_counters["save_seconds"] = Histogram(
                "kvtier_vllm_save_seconds",
                "Time spent gathering a step's finished chunks from the engine (in the forward's critical path)",
                buckets=_STEP_BUCKETS,
                registry=REGISTRY,
            )
            _connector_counters["lookup_seconds"] = Histogram(
                "kvtier_vllm_lookup_seconds",
                "Time from submitting a request's lookup to its answer (scheduler; host-memory answers included)",
                buckets=_STEP_BUCKETS,
                registry=REGISTRY,
            )
            _connector_counters["lookup_deferred"] = Counter(
                "kvtier_vllm_lookup_deferred",
                "Scheduler steps a request waited for its lookup (each costs the request one engine step)",
                registry=REGISTRY,
            )
            _connector_counters["saved_chunks"] = Counter(
                "kvtier_vllm_saved_chunks", "Chunks gathered from the engine and handed to the store", registry=REGISTRY
            )
        return _metrics


def counter(name: str):
    metrics()
    return _connector_counters[name]


def acquire(config: StoreConfig, chunk_bytes: int) -> TieredStore:
    m = metrics()
    with _lock:
        entry = _stores.get(config)
        if entry is None:
            entry = _stores[config] = [TieredStore(config, m, chunk_bytes=chunk_bytes), 0]
        entry[1] += 1
        return entry[0]


def release(store: TieredStore) -> None:
    with _lock:
        for cfg, entry in list(_stores.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] > 0:
                    return
                del _stores[cfg]
                break
        else:
            return
    store.close()


def set_prefetch(req_id: str, fut: Prefetch) -> None:
    with _lock:
        _prefetches[req_id] = fut


def pop_prefetch(req_id: str) -> Prefetch | None:
    with _lock:
        return _prefetches.pop(req_id, None)


def stores() -> list[TieredStore]:
    """The stores open in this process (benchmarks drop tiers between phases)."""
    with _lock:
        return [entry[0] for entry in _stores.values()]


@atexit.register
def _close_all() -> None:
    """At interpreter exit, drain every store's write-through (bounded by its
    close timeout) so that an engine that exits without calling the
    connector's ``shutdown`` still publishes what it saved."""
    with _lock:
        entries = list(_stores.values())
        _stores.clear()
    for store, _ in entries:
        store.close()
