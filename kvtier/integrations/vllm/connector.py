"""``KVTierConnector``: the class vLLM instantiates, twice (scheduler role and
worker role). It only routes each hook to the side that owns it:
``KVTierScheduler`` decides, ``KVTierWorker`` moves bytes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvtier.codec import DTYPE_SIZES
from kvtier.integrations.vllm import runtime
from kvtier.integrations.vllm.metadata import KVTierMetadata
from kvtier.integrations.vllm.scheduler import KVTierScheduler
from kvtier.integrations.vllm.settings import load_settings
from kvtier.integrations.vllm.worker import KVTierWorker

log = logging.getLogger(__name__)


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = s = load_settings(vllm_config, kv_cache_config)
        ns = s.namespace
        chunk_bytes = ns.num_layers * 2 * ns.num_kv_heads * ns.head_dim * DTYPE_SIZES[s.kv_dtype] * ns.chunk_tokens
        self._store = runtime.acquire(s.store, chunk_bytes)
        self._scheduler: KVTierScheduler | None = None
        self._worker: KVTierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            kinds = {t.name: t.kind for t in self._store.tiers}
            self._scheduler = KVTierScheduler(s, self._store, kinds)
        else:
            group = kv_cache_config.kv_cache_groups[0]
            self._worker = KVTierWorker(s, self._store, list(group.layer_names), kv_cache_config.num_blocks)
        log.info("kvtier connector (%s): tiers %s, chunk %d tokens", role.name,
                 [t.name for t in self._store.tiers], s.store.chunk_tokens)

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

    # ------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

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
        idle = self.has_connector_metadata() and self._get_connector_metadata().idle
        return self._worker.get_finished(finished_req_ids, idle=idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # ------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()
        if self._store is not None:
            runtime.release(self._store)
            self._store = None
