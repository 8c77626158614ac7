"""KV events for kvtier's tiers: what cache-aware routers (llm-d's precise
prefix-cache scorer, Dynamo's KV router) read to know that a block held in
kvtier's host memory, on a node's disk or in the shared tier will hit.

vLLM publishes its own GPU blocks' events when started with
``--kv-events-config``, and a connector's through ``take_events()``; kvtier
adds one ``BlockStored`` when every saving rank's shard of a chunk entered a
tier, and one ``BlockRemoved`` when any rank's shard left it (evicted,
deleted, quarantined, or found missing by a read), in vLLM's own event
types, so that a router's index sees them beside the GPU's:

- ``block_hashes``: vLLM's own hashes of the blocks the chunk covers (one
  chunk is ``chunk_tokens / block_size`` blocks), ``parent_block_hash`` the
  block before it, ``token_ids`` its tokens, ``extra_keys`` per block as
  vLLM makes them (the tenant's ``cache_salt`` on the first block);
- ``medium``: ``CPU`` for a host-memory tier, ``STORAGE`` for the others;
- ``locality``: ``LOCAL`` for a tier only this node reads (memory, node
  memory, disk), ``REMOTE`` for one every instance reads (shared, Redis, S3);
- ``ownership``: the tier's name.

Two sides, like the connector's. ``RankEvents`` (each worker) hears its
store (``TieredStore.listen``) and hands what it heard, named by the TP
group's chunk keys, to the scheduler with each step's worker metadata. It
knows every rank's shard names of a chunk, not only its own: where the
ranks share a tier (node memory, shared), one rank's write may evict
another rank's shard, and only the writer hears it. ``BlockEvents`` (the
scheduler) knows the vLLM blocks of every chunk it asked to save or load
(``remember``), counts the ranks, and makes the events vLLM publishes
(``take``). A chunk the scheduler never saw in this process
(stored before a restart, or by another node) has no vLLM hashes here and
is not published by this engine: whoever stored it published it.

The shared and S3 tiers are every node's: another node's collector, or
``kvtier store gc``, deletes what this engine published. Each collection
pass records what it deleted in the tier's removal journal
(``kvtier.tiers.dir.journal``, ``kvtier.tiers.s3.journal``: a tier's
``journal``); ``Journals`` reads it every ``JOURNAL_INTERVAL_S`` off the
scheduler thread, and ``BlockEvents`` publishes the removal of the chunks
it had published there.

Cost: nothing unless vLLM was started with KV events enabled (no listener,
no bookkeeping).

Threads: ``RankEvents.stored``/``removed`` on any store thread (a lock);
``name`` and ``take`` on the worker thread. ``BlockEvents`` on vLLM's
scheduler thread only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtier.concurrency.executor import MAINTENANCE as JOURNAL_PRIORITY
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

STORED, REMOVED = "stored", "removed"
# A heard event, named by the TP group's chunk key: (kind, tier, group digest).
Heard = tuple[str, str, bytes]

# Chunks whose vLLM blocks (and shard names) are kept, most recent first out
# last: a chunk older than this that leaves a tier is not published.
REMEMBERED_CHUNKS = 65536
# Heard events a worker holds between two steps; past it they are dropped and counted.
PENDING_LIMIT = 100_000
# How often the scheduler reads the shared tiers' removal journals.
JOURNAL_INTERVAL_S = 5.0


def enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with
    ``enable_kv_cache_events``), as its scheduler decides it."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class RankEvents:
    """Worker side: what this rank's store heard, by group key."""

    def __init__(self, metrics: ConnectorMetrics, remembered: int = REMEMBERED_CHUNKS,
                 pending_limit: int = PENDING_LIMIT):
        self.metrics = metrics
        self._remembered = remembered
        self._pending_limit = pending_limit
        self._lock = threading.Lock()
        self._group: OrderedDict[bytes, bytes] = OrderedDict()  # shard digest -> group digest (lock)
        self._pending: list[Heard] = []  # (lock)

    def name(self, group: ChunkKey, shards: Sequence[ChunkKey]) -> None:
        """This rank stores or loads ``group``'s shard; ``shards`` are every
        rank's (this one's among them). A tier the ranks share (node memory,
        shared, S3) may evict another rank's shard from this rank's store:
        the chunk left it then, and only this rank heard it."""
        with self._lock:
            for shard in shards:
                self._group[shard.digest] = group.digest
                self._group.move_to_end(shard.digest)
            while len(self._group) > self._remembered * max(1, len(shards)):
                self._group.popitem(last=False)

    def stored(self, tier: str, digests: list[bytes]) -> None:
        self._heard(STORED, tier, digests)

    def removed(self, tier: str, digests: list[bytes]) -> None:
        self._heard(REMOVED, tier, digests)

    def _heard(self, kind: str, tier: str, digests: list[bytes]) -> None:
        dropped = 0
        with self._lock:
            for d in digests:
                g = self._group.get(d)
                if g is None:
                    continue  # not a chunk this engine saved or loaded here
                if len(self._pending) >= self._pending_limit:
                    dropped += 1
                    continue
                self._pending.append((kind, tier, g))
        if dropped:
            self.metrics.events_dropped.labels("worker_backlog").inc(dropped)

    def take(self) -> list[Heard]:
        """What was heard since the last call (worker thread, once a step)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out


@dataclass(frozen=True)
class Place:
    """Where a tier's chunks are, in the terms of vLLM's events."""

    medium: str  # "CPU" or "STORAGE"
    locality: str  # "LOCAL" or "REMOTE"


def place_of(tier) -> Place:
    """A tier's medium and locality, from its class's declared traits."""
    return Place("CPU" if tier.host_memory else "STORAGE", "REMOTE" if tier.shared_medium else "LOCAL")


@dataclass(frozen=True)
class Blocks:
    """A chunk's vLLM blocks, as its events name them."""

    hashes: tuple  # vLLM's external block hashes, in order
    parent: Any  # the hash of the block before the first (None: the prompt's first)
    tokens: tuple[int, ...]
    extra_keys: list | None  # one entry per block (None: none at all)
    lora_name: str | None
    lora_id: int | None


class BlockEvents:
    """Scheduler side: makes vLLM's events from what the ranks heard."""

    def __init__(self, ranks: int, places: dict[str, Place], block_size: int, metrics: ConnectorMetrics,
                 remembered: int = REMEMBERED_CHUNKS, shards: Callable[[ChunkKey], list[bytes]] | None = None):
        """``ranks``: how many ranks save a shard of each chunk (a chunk is
        in a tier once every one of them said so). ``shards``: the digests
        of a chunk's shards (``Topology.shard``), by which the shared tiers'
        removal journals name them (default: the chunk's own)."""
        self.ranks = ranks
        self._shards = shards or (lambda key: [key.digest])
        self._by_shard: dict[bytes, bytes] = {}  # shard digest -> group digest, of the remembered chunks
        self.places = places
        self.bs = block_size
        self.metrics = metrics
        self._remembered = remembered
        self._blocks: OrderedDict[bytes, Blocks] = OrderedDict()  # group digest -> its blocks
        self._counts: dict[tuple[str, bytes], int] = {}  # stored reports so far, per (tier, chunk)
        self._held: set[tuple[str, bytes]] = set()  # published as stored, not removed since
        self._events: list = []
        self._warned = False

    def remember(self, key: ChunkKey, request, start: int) -> None:
        """``key`` is ``request``'s chunk of tokens from ``start`` (a block
        boundary): keep its vLLM blocks for its events."""
        if key.digest in self._blocks:
            self._blocks.move_to_end(key.digest)
            return
        blocks = chunk_blocks(request, start, key.num_tokens, self.bs)
        if blocks is None:
            self.metrics.events_dropped.labels("no_block_hashes").inc()
            if not self._warned:
                self._warned = True
                log.warning("kvtier: KV events are on but vLLM computed no block hashes for a request "
                            "(prefix caching off?): kvtier's tiers are not published")
            return
        self._blocks[key.digest] = blocks
        for d in self._shards(key):
            self._by_shard[d] = key.digest
        while len(self._blocks) > self._remembered:
            old, _ = self._blocks.popitem(last=False)
            for tier in self.places:
                self._counts.pop((tier, old), None)
                self._held.discard((tier, old))
        if len(self._by_shard) > 2 * self._remembered * max(1, self.ranks):
            self._by_shard = {d: g for d, g in self._by_shard.items() if g in self._blocks}

    def journaled(self, tier: str, digests: Sequence[bytes]) -> None:
        """Shards that a collection pass (any node's) deleted from ``tier``
        (its removal journal): the chunks they belong to left it."""
        self.heard([(REMOVED, tier, g) for g in map(self._by_shard.get, digests) if g is not None])

    def heard(self, heard: Sequence[Heard]) -> None:
        """The ranks' reports of one step (their worker metadata, merged)."""
        for kind, tier, digest in heard:
            blocks, place = self._blocks.get(digest), self.places.get(tier)
            if blocks is None or place is None:
                continue
            k = (tier, digest)
            if kind == STORED:
                if k in self._held:
                    continue
                n = self._counts.get(k, 0) + 1
                if n < self.ranks:
                    self._counts[k] = n
                    continue
                self._counts.pop(k, None)
                self._held.add(k)
                self._events.append(stored_event(blocks, place, tier, self.bs))
            else:
                self._counts.pop(k, None)
                if k not in self._held:
                    continue
                self._held.discard(k)
                self._events.append(removed_event(blocks, place, tier))
            self.metrics.events.labels(tier, kind).inc()

    def take(self) -> list:
        """The events made since the last call, for vLLM to publish."""
        out, self._events = self._events, []
        return out


class Journals:
    """The tiers' removal journals (any tier's ``journal``: shared, S3),
    read every ``interval_s`` on ``pool`` (off the scheduler thread): what
    other nodes' collectors and ``kvtier store gc`` deleted."""

    def __init__(self, tiers: Sequence, pool, interval_s: float = JOURNAL_INTERVAL_S):
        self._journals = [(t.name, t.journal) for t in tiers if getattr(t, "journal", None) is not None]
        self._pool = pool
        self.interval_s = interval_s
        self._next = 0.0
        self._reading = None  # the read in flight

    def poll(self) -> list[tuple[str, list[bytes]]]:
        """What the last read found, if it is done; starts the next one when due."""
        out: list[tuple[str, list[bytes]]] = []
        if self._reading is not None and self._reading.done():
            try:
                out = self._reading.result()
            except Exception as exc:  # the journal is a hint: the next read tries again
                log.warning("kvtier: reading the removal journals failed: %s", exc)
            self._reading = None
        now = time.monotonic()
        if self._journals and self._reading is None and now >= self._next:
            self._next = now + self.interval_s
            self._reading = self._pool.submit(JOURNAL_PRIORITY, self._read)
        return out

    def _read(self) -> list[tuple[str, list[bytes]]]:
        return [(name, j.read_new()) for name, j in self._journals]


def chunk_blocks(request, start: int, n: int, block_size: int) -> Blocks | None:
    """The vLLM blocks of ``request``'s tokens ``[start, start + n)``, or
    None where vLLM has no hashes for them."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash

    hashes = getattr(request, "block_hashes", None) or []
    first, last = start // block_size, (start + n) // block_size
    if start % block_size or n % block_size or len(hashes) < last:
        return None
    keys = [generate_block_hash_extra_keys(request, b * block_size, (b + 1) * block_size, 0)[0]
            for b in range(first, last)]
    lora = getattr(request, "lora_request", None)
    return Blocks(
        tuple(maybe_convert_block_hash(hashes[b]) for b in range(first, last)),
        maybe_convert_block_hash(hashes[first - 1]) if first else None,
        tuple(request.all_token_ids[start : start + n]),
        _event_extra_keys(keys),
        lora.name if lora is not None else None,
        lora.adapter_id if lora is not None else None,
    )


def _event_extra_keys(keys: list) -> list | None:
    """vLLM's published form of per-block extra keys, as its own events
    have them: 0.31+ tags them internally and untags them for events
    (``to_event_extra_keys``); 0.30 publishes them as they are."""
    try:
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
    except ImportError:
        return keys or None
    return to_event_extra_keys(keys)


def _event(cls, **fields):
    """``cls(**fields)`` with the fields this vLLM's event type has."""
    known = getattr(cls, "__struct_fields__", None)
    return cls(**({k: v for k, v in fields.items() if k in known} if known else fields))


def stored_event(b: Blocks, place: Place, tier: str, block_size: int):
    from vllm.distributed.kv_events import BlockStored

    return _event(BlockStored, block_hashes=list(b.hashes), parent_block_hash=b.parent, token_ids=list(b.tokens),
                  block_size=block_size, lora_id=b.lora_id, medium=place.medium, lora_name=b.lora_name,
                  extra_keys=b.extra_keys, group_idx=0, locality=place.locality, ownership=tier)


def removed_event(b: Blocks, place: Place, tier: str):
    from vllm.distributed.kv_events import BlockRemoved

    return _event(BlockRemoved, block_hashes=list(b.hashes), medium=place.medium, group_idx=0,
                  locality=place.locality, ownership=tier)
