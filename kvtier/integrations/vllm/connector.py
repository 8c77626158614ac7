"""``KVTierConnector``: the class vLLM instantiates, once for the scheduler
role and once per worker (one per TP rank). It only routes each hook to the
side that owns it: ``KVTierScheduler`` decides from a ``GroupView`` of every
rank's tiers, ``KVTierWorker`` moves its rank's bytes through a store of its
own. The two sides share no Python object: they may run in one process or in
several, and behave the same (what crosses between them is the metadata
vLLM pickles, and the tiers themselves).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
)

from kvtier.codec import DTYPE_SIZES
from kvtier.errors import ConfigError
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm import events
from kvtier.integrations.vllm.group import GroupView, reader_class
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.metrics import connector_metrics
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.settings import load_settings
from kvtier.integrations.vllm.worker import KVTierWorker
from kvtier.tiers.base import Maintenance

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """kvtier's log lines go where vLLM's go, in its format, unless the
    application gave the ``kvtier`` logger handlers of its own (without
    this, INFO lines vanish and warnings reach stderr unformatted)."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


class PageHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side once its KV caches are
    registered: its page layout (``KVTierWorker.page``), which completes
    the namespace. vLLM 0.30-0.33 collect it from every worker before the
    engine takes requests (``get_handshake_metadata``)."""

    def __init__(self, page: str):
        self.page = page


class KVTierConnector(KVConnectorBase_V1):
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        # vLLM 0.33's sleep mode frees the KV cache and hands the connector
        # new tensors on wake; kvtier does not follow them yet, so vLLM
        # refuses --enable-sleep-mode with kvtier at start (docs/vllm.md).
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        worker = role != KVConnectorRole.SCHEDULER
        self._settings = s = load_settings(vllm_config, kv_cache_config, worker=worker)
        ns, topo = s.namespace, s.topology
        # One shard of one chunk (the KV cache spec counts this rank's heads).
        chunk_bytes = ns.num_layers * 2 * topo.heads_per_rank * ns.head_dim * DTYPE_SIZES[s.kv_dtype] * ns.chunk_tokens
        m = connector_metrics()
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if not worker:
            view = GroupView(s, m.store, chunk_bytes)
            published = None
            if events.enabled(vllm_config):
                places = {t.name: events.place_of(t) for t in view.stores[0].tiers}
                published = events.BlockEvents(len(topo.shard_ranks), places, s.block_size, m,
                                               shards=lambda key: [k.digest for k in topo.shards(key)])
            self._scheduler = KVTierScheduler(s, view, m, bytes_per_token=chunk_bytes * len(topo.shard_ranks)
                                              / ns.chunk_tokens, events=published)
            tiers = [t.name for t in view.stores[0].tiers]
        else:
            # A rank that does not write (replicated KV, rank > 0) reads the
            # writer's disk folder without owning it.
            store = TieredStore(topo.shard_config(s.store, topo.own_shard), m.store, chunk_bytes=chunk_bytes,
                                tier_class=None if topo.saves else reader_class)
            group = kv_cache_config.kv_cache_groups[0]
            # Only the ranks that save report what their stores hear.
            heard = events.RankEvents(m) if events.enabled(vllm_config) and topo.saves else None
            self._worker = KVTierWorker(s, store, list(group.layer_names), kv_cache_config.num_blocks, m, heard)
            # An engine that exits without calling shutdown still publishes
            # what it saved (the store's close drains its write-through).
            atexit.register(self._worker.close)
            tiers = [t.name for t in store.tiers]
        # The namespace digest roots every key (a hash; it names no model or
        # tenant): operators compare it across nodes that should share KV.
        # The scheduler side logs it once the workers' pages complete it.
        log.info("kvtier connector (%s%s): tiers %s, chunk %d tokens, TP %d%s", role.name,
                 "" if topo.rank is None else f" rank {topo.rank}", tiers, s.store.chunk_tokens, topo.tp_size,
                 " (replicated KV)" if topo.replicated else "")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a preempted request may always recompute

    # ------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        """kvtier's tiers' KV events since the last call (events.py); vLLM
        publishes them with its own when ``--kv-events-config`` enables them."""
        if self._scheduler is None or self._scheduler.events is None:
            return ()
        return self._scheduler.events.take()

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, backend=_backend_name(self._vllm_config, self._worker.layer_names))

    def build_connector_worker_meta(self):
        if self._worker is None:
            return None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._worker.worker_meta(meta.step if isinstance(meta, KVTierMetadata) else 0)

    def get_handshake_metadata(self) -> PageHandshake | None:
        if self._worker is None or self._worker.layout is None:
            return None
        return PageHandshake(self._worker.page)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """Every worker's page layout (scheduler side); ranks of one engine
        must agree."""
        pages = {m.page for m in (metadata or {}).values() if isinstance(m, PageHandshake)}
        if self._scheduler is None or not pages:
            return
        if len(pages) > 1:
            raise ConfigError("kv_caches", f"the TP ranks' KV pages differ: {sorted(pages)}",
                              "report it with this message: every rank of an engine must lay out its KV alike")
        self._scheduler.set_page(pages.pop())

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if self.has_connector_metadata():
            self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete before vLLM schedules the request

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # whole chunks are gathered in wait_for_save

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._worker.get_finished(finished_req_ids, idle=bool(meta and meta.idle),
                                         release=meta.release if meta else 0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------ benchmarks
    # Called on the workers through vLLM's collective_rpc (see
    # kvtier.bench.worker_ext): the worker's store is in the worker's process.
    def flush_saves(self, timeout: float | None = 60.0) -> bool:
        """Wait for this worker's write-through to drain."""
        return self._worker is None or self._worker.store.flush(timeout)

    def clear_tiers(self, names) -> int:
        """Empty the named tiers this worker opened; the count of objects removed."""
        if self._worker is None:
            return 0
        return sum(t.clear() for t in self._worker.store.tiers if t.name in set(names) and isinstance(t, Maintenance))

    def drop_page_cache(self) -> int:
        """Drop this worker's file tiers' objects from the page cache."""
        if self._worker is None:
            return 0
        return sum(t.drop_cache() for t in self._worker.store.tiers if isinstance(t, Maintenance))

    # ------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
        if self._worker is not None:
            atexit.unregister(self._worker.close)
            self._worker.close()
            self._worker = None


def _backend_name(vllm_config: Any, layer_names: list[str]) -> str:
    """The attention backend the worker's layers run (vLLM picks it per
    layer; kvtier's group is uniform), e.g. ``CPU_ATTN``, ``FLASH_ATTN``."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    names = set()
    for n in layer_names:
        backend = getattr(ctx.get(n), "attn_backend", None)
        if backend is not None:
            try:
                names.add(str(backend.get_name()))
            except Exception:
                names.add(getattr(backend, "__name__", "unknown"))
    return "+".join(sorted(names)) or "unknown"
