"""Writes a worker's own shard of the chunks a step completed into its store.

Saves run after the step's forward pass (vLLM's ``wait_for_save``), while
the blocks are certainly valid: one copy of each chunk's blocks into a
pooled chunk object, under this rank's shard of the chunk's key; the store
keeps it in memory and writes it through in the background. From device
tensors the copy to the host is enqueued behind the forward (the host does
not wait) and the bytes reach the store from the saver thread once it
completed (transfer.py).

Threads: ``save`` on the engine thread; ``_store_saved`` on this object's
saver pool (device tensors only). A failed save costs a future hit, never
the request.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from kvtier.codec import ChunkObject, build, encode
from kvtier.concurrency.executor import STORE, PriorityExecutor
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.layout import PageLayout
from kvtier.integrations.vllm.metadata import SaveJob
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)


class Saver:
    def __init__(self, store: TieredStore, layout: PageLayout, kv_dtype: str, key: Callable[[ChunkKey], ChunkKey],
                 metrics: ConnectorMetrics, device=None):
        """``key``: this rank's shard of a group's chunk key; ``device``: a
        ``DevicePath`` for device tensors (None: CPU pages, copied here)."""
        self.store = store
        self.layout = layout
        self.kv_dtype = kv_dtype
        self._key = key
        self.metrics = metrics
        self.device = device
        self._saver = PriorityExecutor("vllm-save", 1) if device is not None else None

    def save(self, job: SaveJob) -> None:
        if self.device is not None:
            self._save_from_device(job)
            return
        layout, dtype = self.layout, self.layout.dtype
        objs: list[ChunkObject] = []
        try:
            for c in job.chunks:
                shape = layout.chunk_shape(len(c.block_ids))

                def fill(buf, ids=c.block_ids, shape=shape):
                    layout.gather(ids, torch.frombuffer(buf, dtype=dtype).view(shape))

                objs.append(build(self._key(c.key), self.kv_dtype, shape, fill, self.store.pool))
            self.store.put(objs)
            self.metrics.saved_chunks.inc(len(objs))
        except Exception as exc:  # a failed save costs a future hit, never this request
            log.warning("kvtier: save for %s failed: %s", job.req_id, exc)
        finally:
            for o in objs:
                o.release()

    def _save_from_device(self, job: SaveJob) -> None:
        """Enqueue each chunk's device-to-host copy behind this step's
        forward (the host does not wait); the saver thread hands the bytes
        to the store once the copy completed."""
        try:
            pending = [(c, self.device.save(c.block_ids)) for c in job.chunks]
        except Exception as exc:  # a failed save costs a future hit, never this request
            log.warning("kvtier: save for %s failed: %s", job.req_id, exc)
            return
        self._saver.submit(STORE, self._store_saved, job.req_id, pending)

    def _store_saved(self, req_id: str, pending) -> None:
        objs: list[ChunkObject] = []
        try:
            for c, p in pending:
                payload = self.device.saved_bytes(p)  # waits for the copy
                objs.append(encode(self._key(c.key), self.kv_dtype, p.shape, payload, self.store.pool))
            self.store.put(objs)
            self.metrics.saved_chunks.inc(len(objs))
        except Exception as exc:
            log.warning("kvtier: save for %s failed: %s", req_id, exc)
        finally:
            for o in objs:
                o.release()
            for _, p in pending:
                self.device.release(p)

    def close(self) -> None:
        """Wait for the device saves handed to the saver thread."""
        if self._saver is not None:
            self._saver.close()
