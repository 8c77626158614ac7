"""Where the connector runs in vLLM's process topology, and which tiers each
of its processes opens.

Under tensor parallelism each rank holds other KV heads of the same tokens:
each rank stores and loads only its own shard, under its own key
(``shard_key``); a chunk is a hit only when every rank's shard is there.
Where every rank holds the same KV (MLA's latent cache is replicated), a
chunk is one object, written by rank 0 and read by all.

``memory`` tiers become the node's shared memory tier (``shm``), so that
the scheduler, every worker and every other engine of the node see one host
memory; a ``disk`` tier holds one folder per TP rank, owned by the worker
of that rank, which the scheduler reads without owning (docs/vllm.md).

Threads: none of its own; read once at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from kvtier.config import StoreConfig, TierSpec
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey, shard_key


@dataclass(frozen=True)
class Topology:
    """This connector's place among the TP group's processes."""

    tp_size: int
    rank: int | None  # this worker's TP rank; None for the scheduler side
    replicated: bool = False
    heads: int = 1  # KV heads of the whole model (each rank holds heads / tp_size)
    # Other TP sizes whose shards this engine can assemble its own from (a
    # store written at TP=2 read at TP=1, and the reverse): every size that
    # divides the heads (on CPU; see other_tp_sizes).
    other_tp_sizes: tuple[int, ...] = ()

    @property
    def shard_ranks(self) -> range:
        """The ranks whose objects make up one chunk."""
        return range(1) if self.replicated else range(self.tp_size)

    @property
    def own_shard(self) -> int:
        """The shard this worker reads and writes."""
        assert self.rank is not None, "the scheduler side has no shard"
        return 0 if self.replicated else self.rank

    @property
    def saves(self) -> bool:
        return self.rank is not None and (not self.replicated or self.rank == 0)

    @property
    def heads_per_rank(self) -> int:
        return self.heads if self.replicated else self.heads // self.tp_size

    def shard(self, key: ChunkKey, shard: int, tp_size: int | None = None) -> ChunkKey:
        """Shard ``shard`` of chunk ``key`` as written at ``tp_size`` (this engine's by default)."""
        return key if self.replicated else shard_key(key, shard, tp_size or self.tp_size)

    def shards(self, key: ChunkKey) -> list[ChunkKey]:
        """Every rank's shard of chunk ``key``, as this engine writes them."""
        return [self.shard(key, r) for r in self.shard_ranks]

    def sources(self, rank: int, tp_size: int) -> range:
        """The shards of a chunk written at ``tp_size`` that hold this
        engine's rank ``rank``'s heads."""
        lo = rank * tp_size // self.tp_size
        hi = ((rank + 1) * tp_size - 1) // self.tp_size
        return range(lo, hi + 1)

    def disk_path(self, path: str, shard: int) -> str:
        """The folder of a disk tier that holds ``shard``'s objects."""
        if self.tp_size == 1:
            return path
        return os.path.join(path, f"tp{self.tp_size}-rank{shard}")

    def shard_config(self, store: StoreConfig, shard: int, tp_size: int | None = None) -> StoreConfig:
        """The store of the worker that owns ``shard``: disk tiers in the
        shard's folder, each with its share of the capacity. With another
        ``tp_size`` (shards other engines wrote): no disk tier (a node-local
        folder of another engine's rank), the node memory and shared tiers."""
        n = len(self.shard_ranks)
        tiers = []
        for spec in store.tiers:
            if spec.kind == "disk" and tp_size not in (None, self.tp_size):
                continue
            if spec.kind == "disk":
                cfg = replace(spec.config, path=self.disk_path(spec.config.path, shard),
                              capacity=max(1, spec.config.capacity // n))
                spec = TierSpec(spec.kind, cfg)
            tiers.append(spec)
        return replace(store, tiers=tuple(tiers))


def engine_topology(vllm_config: Any, spec: Any, worker: bool, share_tp_sizes: Any) -> Topology:
    """The topology of the engine vLLM configured, for its scheduler side
    (``worker`` False) or for the worker of this process's TP rank.
    ``spec``: the KV cache spec (its heads are one rank's)."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise ConfigError("pipeline_parallel_size", f"is {pc.pipeline_parallel_size}: each pipeline stage holds other layers",
                          "run kvtier with pipeline_parallel_size 1 (tensor and data parallel are supported)")
    tp = int(pc.tensor_parallel_size)
    replicated = bool(getattr(mc, "use_mla", False))
    heads = int(spec.num_kv_heads) * (1 if replicated else tp)
    others = other_tp_sizes(tp, heads, replicated, share_tp_sizes)
    return Topology(tp, _tp_rank() if worker else None, replicated, heads, others)


def other_tp_sizes(tp: int, heads: int, replicated: bool, wanted) -> tuple[int, ...]:
    """TP sizes besides ``tp`` whose shards can be assembled into ours:
    ``wanted`` (``share_tp_sizes`` in kv_connector_extra_config), or by
    default every size up to 8 that divides the model's KV heads. Every
    page layout keeps heads apart (``PageLayout.head_axis``), but only the
    CPU one has run it end to end, so only there; never for replicated KV
    (one object serves every TP size)."""
    from vllm.platforms import current_platform

    if replicated or current_platform.device_type != "cpu":
        return ()
    if wanted is None:
        wanted = [m for m in (1, 2, 4, 8) if heads % m == 0]
    try:
        sizes = sorted({int(m) for m in wanted})
    except (TypeError, ValueError):
        raise ConfigError("share_tp_sizes", f"expected a list of TP sizes, got {wanted!r}", "write e.g. [1, 2, 4]") from None
    bad = [m for m in sizes if m <= 0 or heads % m]
    if bad:
        raise ConfigError("share_tp_sizes", f"{bad[0]} does not divide the model's {heads} KV heads",
                          f"use sizes that divide {heads}, e.g. {[m for m in (1, 2, 4, 8) if heads % m == 0]}")
    return tuple(m for m in sizes if m != tp)


def node_memory(store: StoreConfig) -> StoreConfig:
    """``memory`` tiers as the node's memory tier (``shm``, same name and
    capacity, in ``node_memory_dir``): a process-local memory is invisible to
    vLLM's other processes and would hold one copy per engine."""
    from kvtier.tiers.shm import ShmConfig, default_dir

    root = store.node_memory_dir or default_dir()
    tiers = []
    for i, spec in enumerate(store.tiers):
        if spec.kind == "memory":
            cfg = spec.config
            if cfg.eviction != "lru":
                # The node's memory is shared by processes that see each
                # other's reads only as recency stamps: it ranks by recency.
                raise ConfigError(f"tiers[{i}].eviction", f"is {cfg.eviction!r}, but under vLLM a memory tier is the "
                                  "node's memory, shared by every process, which ranks objects by recency only",
                                  "use lru (the default) for a memory tier the vLLM connector runs")
            spec = TierSpec("shm", ShmConfig(capacity=cfg.capacity, name=cfg.name, path=os.path.join(root, cfg.name)))
        tiers.append(spec)
    return replace(store, tiers=tuple(tiers))


def _tp_rank() -> int:
    """The worker's TP rank (vLLM sets up its groups before the connector)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("tensor_parallel_size", "the worker's tensor-parallel group is not set up",
                          "report this vLLM version: kvtier expects its groups before the KV connector")
    return int(parallel_state.get_tensor_model_parallel_rank())
