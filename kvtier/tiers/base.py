"""The one contract every tier implements.

    lookup(keys)        -> how many leading keys the tier holds
    fetch(keys, ...)    -> iterator over the leading objects it can serve,
                           verified, in order; stops at the first miss
    load(keys, bufs)    -> copy leading payloads into caller-owned buffers
    store(objs)         -> how many leading objects are now held
    delete(keys)        -> how many were removed
    stats()             -> TierStats
    close()

Keys are ``ChunkKey``; objects are ``ChunkObject``. Every method is batched.
A tier never raises for storage trouble: it counts it and answers with a
shorter prefix.

Objects yielded by ``fetch`` are lent: valid until the consumer resumes the
iterator. A persistent tier hands each object over with its reference (the
consumer calls ``release`` when done, or ``retain`` to keep it longer); the
memory tier keeps its own reference and pins the entry while it is lent.
``persistent`` tells which. ``host_memory`` marks the tiers that keep chunks
in host DRAM (the process-local ``memory`` tier, the node-wide ``shm`` tier):
the store's first such tier is its memory level. Buffers passed to ``load`` belong to the caller and
are only written before ``load`` returns.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Iterator, Sequence

from kvtier.buffers import BufferPool, copy_into
from kvtier.codec import ChunkObject
from kvtier.engine.breaker import CircuitBreaker
from kvtier.keys import ChunkKey
from kvtier.metrics import Metrics, TierMetrics


@dataclass(frozen=True)
class TierStats:
    name: str
    kind: str
    objects: int
    used_bytes: int
    capacity_bytes: int


class Tier(abc.ABC):
    kind: ClassVar[str]
    Config: ClassVar[type]
    persistent: ClassVar[bool] = True
    # Chunks held in host DRAM: the store's memory level (promotion and
    # prefetch target; the vLLM connector copies such hits in synchronously).
    host_memory: ClassVar[bool] = False

    def __init__(
        self,
        config,
        metrics: Metrics | None = None,
        breaker: CircuitBreaker | None = None,
        pool: BufferPool | None = None,
    ):
        self.config = config
        self.breaker = breaker or CircuitBreaker()
        self.pool = pool if pool is not None else BufferPool()
        self.name: str = config.name
        self.metrics: TierMetrics = (metrics or Metrics()).for_tier(self.name)
        self.metrics.capacity(config.capacity)

    @abc.abstractmethod
    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int: ...

    @abc.abstractmethod
    def fetch(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> Iterator[ChunkObject]: ...

    @abc.abstractmethod
    def store(self, objs: Sequence[ChunkObject]) -> int: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def load(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview], timeout: float | None = None) -> int:
        """Copy the leading payloads into ``bufs`` (each exactly a payload long).

        A buffer whose size does not match the stored payload ends the prefix.
        """
        n = 0
        it = self.fetch(keys, timeout)
        try:
            for obj, buf in zip(it, bufs):
                try:
                    if memoryview(buf).nbytes != obj.header.payload_len:
                        break
                    copy_into(memoryview(buf).cast("B"), obj.payload)
                    n += 1
                finally:
                    if self.persistent:
                        obj.release()
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
