"""Worker side: moves bytes between vLLM's KV cache and kvtier. Decides nothing.

Threads:
- vLLM's worker thread calls every public method.
- Loads run on this object's ``_loader`` pool: the blocks they write belong
  to requests vLLM holds back (WAITING_FOR_REMOTE_KVS) until ``get_finished``
  reports them, so nothing else touches those blocks meanwhile. Every load
  that was started is reported, failed or not: vLLM keeps the blocks until
  then, even for a request aborted meanwhile.
- Saves run in the worker thread in ``wait_for_save``, after the forward pass,
  while the blocks are certainly valid: one copy of each block into a pooled
  chunk object; the store writes it through in the background.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from kvtier.codec import ChunkObject, build
from kvtier.engine.executor import LOAD, PriorityExecutor
from kvtier.engine.store import TieredStore
from kvtier.errors import ConfigError
from kvtier.integrations.vllm import runtime
from kvtier.integrations.vllm.layout import BlockLayout, detect
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadJob, SaveJob
from kvtier.integrations.vllm.settings import Settings

log = logging.getLogger(__name__)


class KVTierWorker:
    def __init__(self, settings: Settings, store: TieredStore, layer_names: list[str], num_blocks: int):
        self.settings = settings
        self.store = store
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.layout: BlockLayout | None = None
        self._loader = PriorityExecutor("vllm-load", 2)
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self._done: dict[str, set[int]] = {}  # finished loads -> their failed blocks
        self._errors_to_report: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV cache tensor for layer {missing[0]}", "report this vLLM version")
        layers = [kv_caches[n] for n in self.layer_names]
        self.layout = detect(layers, self.num_blocks)
        dtype = str(self.layout.dtype).removeprefix("torch.")
        if dtype != self.settings.kv_dtype:
            raise ConfigError("kv_cache_dtype", f"KV tensors are {dtype}, the spec says {self.settings.kv_dtype}", "report this vLLM version")
        log.info("kvtier: %d layers, layout %s, chunk shape %s", len(layers), self.layout.name,
                 self.layout.chunk_shape(self.settings.store.chunk_tokens // self.settings.block_size))

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        for job in meta.loads:
            with self._lock:
                if job.req_id in self._started:
                    continue
                self._started.add(job.req_id)
            fut = self._loader.submit(LOAD, self._load, job)
            fut.add_done_callback(lambda f, job=job: self._loaded(job, f))

    def _load(self, job: LoadJob) -> set[int]:
        """Scatter the job's chunks into their blocks; returns the blocks that
        could not be loaded (vLLM recomputes them)."""
        layout = self.layout
        prefetch = runtime.pop_prefetch(job.req_id)
        if prefetch is not None:
            try:  # let the prefetch started at lookup finish: no second read
                prefetch.result(timeout=self.settings.store.load_timeout_s)
            except (FutureTimeout, Exception):
                pass
        dtype = self.layout.dtype
        loaded = 0
        it = self.store.fetch([c.key for c in job.chunks])
        try:
            for c, obj in zip(job.chunks, it):
                shape = layout.chunk_shape(len(c.block_ids))
                h = obj.header
                if h.shape != shape or h.dtype != self.settings.kv_dtype:
                    log.warning("kvtier: chunk %s has shape %s %s, expected %s %s; recomputing",
                                c.key.hex[:16], h.shape, h.dtype, shape, self.settings.kv_dtype)
                    break
                src = torch.frombuffer(obj.payload, dtype=dtype).view(shape)
                layout.scatter(c.block_ids, src, first=c.skip)
                loaded += 1
        finally:
            it.close()
        return {b for c in job.chunks[loaded:] for b in c.block_ids[c.skip :]}

    def _loaded(self, job: LoadJob, fut) -> None:
        try:
            failed = fut.result()
        except BaseException as exc:  # a failed load is a recompute, never a failed request
            log.warning("kvtier: load for %s failed: %s; recomputing", job.req_id, exc)
            failed = {b for c in job.chunks for b in c.block_ids[c.skip :]}
        with self._lock:
            self._done[job.req_id] = failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done = self._done, {}
            for rid, failed in done.items():
                self._started.discard(rid)
                self._errors_to_report |= failed
        return None, (set(done) or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors_to_report = self._errors_to_report, set()
        return errors

    # ------------------------------------------------------------ saves
    def wait_for_save(self, meta: KVTierMetadata) -> None:
        for job in meta.saves:
            self._save(job)

    def _save(self, job: SaveJob) -> None:
        layout, dtype = self.layout, self.layout.dtype
        objs: list[ChunkObject] = []
        try:
            for c in job.chunks:
                shape = layout.chunk_shape(len(c.block_ids))

                def fill(buf, ids=c.block_ids, shape=shape):
                    layout.gather(ids, torch.frombuffer(buf, dtype=dtype).view(shape))

                objs.append(build(c.key, self.settings.kv_dtype, shape, fill, self.store.pool))
            self.store.put(objs)
            runtime.counter("saved_chunks").inc(len(objs))
        except Exception as exc:  # a failed save costs a future hit, never this request
            log.warning("kvtier: save for %s failed: %s", job.req_id, exc)
        finally:
            for o in objs:
                o.release()

    def close(self) -> None:
        self._loader.close()
