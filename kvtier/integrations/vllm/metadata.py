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
    # Asynchronous loads under load_decision auto (None: unbounded): seconds
    # the load may read from when its reads start (costs.LoadCosts.budget),
    # and the engine's prefill seconds per token, against which the worker
    # projects the load's remainder from the chunks that arrived.
    budget_s: float | None = None
    prefill_s_per_token: float | None = None


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
    # At most this many finished asynchronous loads may be handed to the
    # engine this step, oldest first (0: all): the scheduler paces them
    # when each loaded request's own compute outweighs a step (scheduler.py).
    release: int = 0
    # The step's number (``LoadCosts.step_scheduled``), sent back with its
    # output so that the scheduler times each step by its own output.
    step: int = 0


@dataclass
class KVTierWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: the asynchronous loads that finished
    this step, per request (the load's share of its worker's reading time,
    tokens it brought into the engine; see costs.py), and those the worker
    stopped before they were done (``stopped``: why, "budget" or
    "projected"). A load cut short (timeout, a bad chunk, a stop) counts
    only what arrived, so a tier too slow to finish within its deadline
    still shows its true speed. vLLM merges the ranks' metadata of one step
    with ``aggregate`` (the slowest rank, the fewest tokens, any rank's
    stop); ranks that finish in other steps send theirs then, and the
    scheduler merges those the same way until vLLM reports the load done.

    ``step`` is the number of the step this output belongs to; the workers
    send it every step, so that vLLM never drops a step's output as empty
    and the scheduler's step timer sees every step (costs.py).

    ``events``: with KV events on, what each rank's store heard since its
    last step, by group key (events.py); merged, every rank's reports."""

    reads: dict[str, tuple[float, int]] = field(default_factory=dict)
    stopped: dict[str, str] = field(default_factory=dict)
    step: int = 0
    events: list[tuple[str, str, bytes]] = field(default_factory=list)

    def aggregate(self, other: "KVTierWorkerMeta") -> "KVTierWorkerMeta":
        merged = dict(self.reads)
        for rid, read in other.reads.items():
            merged[rid] = merge_reads(merged.get(rid), read)
        return KVTierWorkerMeta(merged, {**other.stopped, **self.stopped}, max(self.step, other.step),
                                self.events + other.events)


def merge_reads(a: tuple[float, int] | None, b: tuple[float, int]) -> tuple[float, int]:
    """Two ranks' view of one load: the slowest read, the fewest tokens."""
    return b if a is None else (max(a[0], b[0]), min(a[1], b[1]))
