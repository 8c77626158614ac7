"""Reads a worker's own shard of a load's chunks from its store.

Keys: the scheduler sends the TP group's chunk keys; this rank reads only
its own shard of each, under the shard's key (``Topology.shard``). A chunk
held at another TP size (``ChunkIO.source_tp``) is read as the shards of
that size which hold this rank's heads, and this rank's shard is cut from
them (``_assemble``); it is stored under this rank's own key too, so the
next load reads it directly.

The store hands the objects over one by one (``TieredStore.fetching``):
each chunk is handed on as soon as it verified, and only then may the
memory tier take what was read for it, so that the engine gets it first.

Threads: ``read`` runs on the worker's loader pool (asynchronous loads) or
on the engine thread (synchronous ones); the reader keeps no state between
calls.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvtier.codec import DTYPE_SIZES, ChunkObject, encode
from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.layout import PageLayout
from kvtier.integrations.vllm.metadata import ChunkIO, LoadJob
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.settings import Settings
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)


class ShardReader:
    def __init__(self, settings: Settings, store: TieredStore, layout: PageLayout, metrics: ConnectorMetrics):
        self.settings = settings
        self.store = store
        self.layout = layout
        self.metrics = metrics
        self.topology = settings.topology
        self._shard = settings.topology.own_shard

    def key(self, key: ChunkKey) -> ChunkKey:
        """This rank's shard of the group's chunk ``key``."""
        return self.topology.shard(key, self._shard)

    def read(self, job: LoadJob, hand_over: Callable[[ChunkObject], bool] | None = None) -> list[ChunkObject]:
        """Read this rank's shard of the job's chunks. Returns the leading
        chunks that verified and have the expected shape, each retained:
        they stay valid until they are copied into the engine. With
        ``hand_over`` (an asynchronous load) each chunk goes to it as it
        arrives instead, so that the engine thread copies the first chunks
        while later ones are read, until it says to read no more; nothing is
        returned then."""
        t0 = time.perf_counter()
        objs: list[ChunkObject] = []
        wanted = [self._sources(c) for c in job.chunks]
        try:
            with self.store.fetching([k for ks in wanted for k in ks]) as fetch:
                for c, ks in zip(job.chunks, wanted):
                    got: list[ChunkObject] = []
                    for _ in ks:
                        obj = fetch.take()
                        if obj is None:
                            break
                        got.append(obj)
                    obj = self._chunk(c, got) if len(got) == len(ks) else None
                    for o in got:
                        o.release()
                    if obj is None:
                        break
                    if hand_over is None:
                        objs.append(obj)
                    elif not hand_over(obj):
                        break
                    # Handed on: the memory tier may take what was read for it.
                    fetch.promote()
        except BaseException:
            for o in objs:
                o.release()
            raise
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return objs

    def _sources(self, c: ChunkIO) -> list[ChunkKey]:
        """The stored objects that make up this rank's shard of chunk ``c``."""
        if c.source_tp in (0, self.topology.tp_size):
            return [self.key(c.key)]
        return [self.topology.shard(c.key, s, c.source_tp) for s in self.topology.sources(self._shard, c.source_tp)]

    def _chunk(self, c: ChunkIO, got: list[ChunkObject]) -> ChunkObject | None:
        """This rank's shard of ``c`` from the objects read for it (a new
        reference), or None if they do not have the shape expected."""
        shape = self.layout.chunk_shape(c.key.num_tokens // self.settings.block_size)
        native = c.source_tp in (0, self.topology.tp_size)
        if not native:
            axis = self.layout.head_axis
            if axis is None:
                log.warning("kvtier: layout %s cannot assemble shards of TP %d; recomputing", self.layout.name,
                            c.source_tp)
                return None
            per = self.topology.heads // c.source_tp
            shape_src = shape[:axis] + (per,) + shape[axis + 1:]
        for obj in got:
            h = obj.header
            want = shape if native else shape_src
            if h.shape != want or h.dtype != self.settings.kv_dtype:
                log.warning("kvtier: chunk %s has shape %s %s, expected %s %s; recomputing",
                            c.key.hex[:16], h.shape, h.dtype, want, self.settings.kv_dtype)
                return None
        if native:
            return got[0].retain()
        return self._assemble(c, got, shape, axis)

    def _assemble(self, c: ChunkIO, got: list[ChunkObject], shape, axis: int) -> ChunkObject:
        """Cut this rank's heads out of shards written at another TP size.
        Bytes only, with numpy (a torch kernel here would start an OpenMP
        team of its own beside the engine's): heads lie along ``axis``, each
        head's data contiguous within it."""
        import numpy as np

        es = DTYPE_SIZES[self.settings.kv_dtype]
        first = self.topology.sources(self._shard, c.source_tp)[0]
        per_src = self.topology.heads // c.source_tp
        mine = shape[axis]
        parts = [np.frombuffer(o.payload, dtype=np.uint8).reshape(o.header.shape[:-1] + (o.header.shape[-1] * es,))
                 for o in got]
        whole = np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
        lo = self._shard * mine - first * per_src
        part = np.ascontiguousarray(whole.take(range(lo, lo + mine), axis=axis))
        obj = encode(self.key(c.key), self.settings.kv_dtype, shape, memoryview(part).cast("B"), self.store.pool)
        try:
            self.store.put([obj])  # our own shard from now on (memory, and written through)
        except Exception as exc:  # a failed save costs a future hit, never this load
            log.warning("kvtier: storing an assembled shard failed: %s", exc)
        self.metrics.assembled_chunks.inc()
        return obj
