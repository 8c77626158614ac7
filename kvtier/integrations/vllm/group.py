"""The scheduler's view of a TP group's chunks, from the scheduler's process.

vLLM's scheduler decides how many tokens kvtier serves; the workers, one per
TP rank and usually each in its own process, hold the shards. A chunk is a
hit only when every rank's shard of it is present, so the scheduler opens
every tier the workers use, for every shard: the node's memory tier and
shared tiers are the same objects whichever process opens them, and each
rank's disk folder is read without owning it (``DiskReader``; its worker
owns, writes and evicts it). Nothing here depends on sharing a process with
a worker.

Threads: ``lookup`` runs on the scheduler's lookup pool; ``close`` on the
scheduler thread at shutdown.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from kvtier.engine.store import TieredStore
from kvtier.integrations.vllm.settings import Settings
from kvtier.keys import ChunkKey
from kvtier.metrics import Metrics
from kvtier.tiers import registry
from kvtier.tiers.disk import DiskReader


@dataclass(frozen=True)
class GroupHit:
    chunks: int  # leading chunks every shard holds
    tiers: tuple[str, ...]  # per chunk: the slowest tier holding one of its shards
    sources: tuple[int, ...] = ()  # per chunk: the TP size whose shards hold it (0: this engine's own)


class GroupView:
    def __init__(self, settings: Settings, metrics: Metrics | None = None, chunk_bytes: int | None = None,
                 stores: Sequence[TieredStore] | None = None):
        """Opens one store per shard (disk folders as readers). ``stores``:
        stores already open, one per shard, to look up in instead (the view
        then owns them); tests that play the worker side pass their own."""
        self.topology = settings.topology
        self.stores: list[TieredStore] = list(stores or ())
        try:
            for shard in self.topology.shard_ranks[len(self.stores):]:
                self.stores.append(TieredStore(self.topology.shard_config(settings.store, shard), metrics,
                                               chunk_bytes=chunk_bytes, tier_class=reader_class))
        except BaseException:
            self.close()
            raise
        # Stores of the shards other TP sizes write (no disk tier: another
        # engine's node-local folders), opened here: lookups run on several
        # threads and must not open tiers themselves.
        self._other: dict[int, list[TieredStore]] = {}
        try:
            for m in self.topology.other_tp_sizes:
                self._other[m] = [TieredStore(self.topology.shard_config(settings.store, s, m), metrics,
                                              tier_class=reader_class) for s in range(m)]
        except BaseException:
            self.close()
            raise
        first = self.stores[0]
        self._order = {t.name: i for i, t in enumerate(first.tiers)}
        self.host_memory = {t.name for t in first.tiers if t.host_memory}
        self.kinds = {t.name: t.kind for t in first.tiers}

    def lookup(self, keys: Sequence[ChunkKey], skip: frozenset[str] = frozenset()) -> GroupHit:
        """Leading chunks of ``keys`` (the group's chain) whose every shard
        is stored, at this engine's TP size or, where those stop, at another
        one whose shards this engine can assemble its own from. Tiers named
        in ``skip`` are not asked."""
        n, tiers = self._prefix(self.stores, list(self.topology.shard_ranks), None, keys, skip)
        sources = [0] * n
        for m in self.topology.other_tp_sizes:
            if n >= len(keys):
                break
            got, more = self._prefix(self._other[m], list(range(m)), m, keys, skip)
            if got > n:
                tiers += more[n:got]
                sources += [m] * (got - n)
                n = got
        return GroupHit(n, tuple(tiers), tuple(sources))

    def _prefix(self, stores, shards, tp_size, keys, skip=frozenset()) -> tuple[int, list[str]]:
        """Leading chunks whose every shard (of ``tp_size``) is stored, each
        with the slowest tier holding one of its shards. Each shard is asked
        only for the prefix the shards before it hold."""
        n = len(keys)
        slowest = [-1] * n
        names = list(self._order)
        for shard, store in zip(shards, stores):
            if not n:
                break
            plan = store.lookup([self.topology.shard(k, shard, tp_size) for k in keys[:n]], skip)
            n = plan.chunks
            for seg in plan.segments:
                rank = self._order[seg.tier]
                for i in range(seg.start, min(seg.stop, n)):
                    slowest[i] = max(slowest[i], rank)
        return n, [names[slowest[i]] for i in range(n)]

    def probe(self, tier: str, key: ChunkKey, lookup_timeout: float, load_timeout: float) -> tuple[float, int] | None:
        """Read shard 0 of chunk ``key`` from ``tier`` and drop it: (seconds,
        tokens that arrived within ``load_timeout``), or None if the tier
        does not hold it. Runs on the scheduler's probe thread, so that no
        request waits on a tier being re-measured."""
        t = self.stores[0].tier(tier)
        shard = self.topology.shard(key, 0)
        if not t.lookup([shard], lookup_timeout):
            return None
        t0 = time.perf_counter()
        tokens = 0
        for obj in t.fetch([shard], load_timeout):
            tokens += obj.header.num_tokens
            obj.release()
        return time.perf_counter() - t0, tokens

    def slowest(self, tiers: Sequence[str]) -> str:
        """The slowest of ``tiers`` (the deepest in the configured order)."""
        return max(tiers, key=self._order.__getitem__)

    def in_host_memory(self, keys: Sequence[ChunkKey]) -> bool:
        """Every shard of every key is in the node's memory tier (a stat per
        shard on tmpfs: microseconds)."""
        for shard, store in zip(self.topology.shard_ranks, self.stores):
            memory = store.memory
            if memory is None or memory.lookup([self.topology.shard(k, shard) for k in keys]) < len(keys):
                return False
        return bool(keys)

    def close(self) -> None:
        for store in self.stores + [st for group in getattr(self, "_other", {}).values() for st in group]:
            store.close(drain=False)
        self.stores, self._other = [], {}


def reader_class(spec) -> type:
    """Open a disk tier's folder as a reader (its owner is another worker)."""
    return DiskReader if spec.kind == "disk" else registry.resolve(spec.kind)
