"""What the scheduler side tells the worker side each step, and what the
workers tell it back (pickled between processes when vLLM runs them apart,
so plain data only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.keys import ChunkKey


@dataclass
class ChunkIO:
    key: ChunkKey
    # The chunk's engine blocks in token order. For a load this may be fewer
    # than the chunk holds (the claim ends inside it): only these are written.
    block_ids: list[int]
    skip: int = 0  # loads: leading blocks the engine already holds (not written)
    # Loads: the TP size whose shards hold the chunk (0: this engine's own);
    # the worker assembles its shard from them.
    source_tp: int = 0


@dataclass
class LoadJob:
    req_id: str
    chunks: list[ChunkIO]
    tiers: list[str]  # tier holding each chunk at lookup time (for metrics)
    sync: bool = False  # copy in before this step's forward (chunks in host memory)


@dataclass
class SaveJob:
    req_id: str
    chunks: list[ChunkIO]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    # The step computes no token: the engine only waits (for our loads among
    # others), so the worker may block briefly for them instead of spinning.
    idle: bool = False


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: how long the asynchronous loads that
    finished this step took to read (seconds from their start to their last
    byte, per request). vLLM merges the ranks' metadata of one step with
    ``aggregate``; ranks that finish in other steps send theirs then, and the
    scheduler keeps the slowest until vLLM reports the load finished."""

    read_seconds: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: "KVTierWorkerMeta") -> "KVTierWorkerMeta":
        merged = dict(self.read_seconds)
        for rid, s in other.read_seconds.items():
            merged[rid] = max(s, merged.get(rid, 0.0))
        return KVTierWorkerMeta(merged)
