"""The one contract every tier implements, whole: everything ``TieredStore``
(``engine/store.py``) calls on a tier is declared here.

    lookup(keys)        -> how many leading keys the tier holds
    fetch(keys, ...)    -> iterator over the leading objects it can serve,
                           verified, in order; stops at the first miss
    done_with(obj)      -> the consumer of ``fetch`` is done with ``obj``
    load(keys, bufs)    -> leading payloads into the caller's buffers (or lent
                           ``LoadBuffers``); how many
    store(objs)         -> how many leading objects are now held
    store_async(objs)   -> a future of ``store(objs)`` (write-through)
    delete(keys)        -> how many were removed
    stats()             -> TierStats
    close()

and the attributes ``name``, ``kind``, ``config``, ``metrics`` (its
``TierMetrics``), ``breaker``, ``persistent``, ``host_memory`` and
``keeps_buffers``.

Who hears of objects leaving a tier: ``on_removed`` (None by default; the
store sets it when something listens, e.g. KV events for routers), called
as ``on_removed(tier_name, digests)`` by the tier that evicted, deleted,
cleared or quarantined them, on that thread, possibly under the tier's
lock: a listener only records, quickly, and never calls back into the
tier. A tier tells what it removes itself; what another process removes
(another node's collector, ``kvtier store gc``) it cannot see.

Keys are ``ChunkKey``; objects are ``ChunkObject``. Every method is batched.
A tier never raises for storage trouble: it counts it and answers with a
shorter prefix.

Who owns a fetched object: the tier says, through ``done_with``. Objects
yielded by ``fetch`` are valid until the consumer resumes the iterator or,
past that, until it calls ``done_with(obj)`` (``obj.retain()`` keeps one
longer, released by the consumer). By default a tier hands each object over
with its reference and ``done_with`` releases it; the memory tier lends its
own, pinned while lent, and its ``done_with`` does nothing.

``persistent``: the tier's objects outlive the process (it is a
write-through target and a reopened tier still holds them). ``host_memory``
marks the tiers that keep chunks in host DRAM (the process-local ``memory``
tier, the node-wide ``shm`` tier): the store's first such tier is its memory
level. Buffers passed to ``load`` belong to the caller and are only written
before ``load`` returns. ``keeps_buffers``: the tier keeps objects it is
handed (``store``) in their own buffers, for long (the process-local
``memory`` tier); a store none of whose tiers does gives its O_DIRECT reads
buffers of whole huge pages (``BufferPool.whole_reads``), which cost more
memory per buffer than a kept object should.

Optional abilities are protocols beside the contract, never probed by name:
``Maintenance`` (``clear``, ``drop_cache``) for tests, benchmarks and
administration; ``FetchInto`` (``fetch_into``: ``fetch`` that copies each
object into the caller's buffer where it verifies it, so that a load's
copies run on as many cores as its checks); check with ``isinstance``.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Protocol, Sequence, runtime_checkable

from kvtier.buffers import BufferPool, LoadBuffers, copy_into, load_views, slot
from kvtier.codec import ChunkObject
from kvtier.concurrency.breaker import CircuitBreaker
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
    # Keeps the buffers of objects it stores (retains them; see the module's note).
    keeps_buffers: ClassVar[bool] = False
    # Other nodes write its medium too (a shared mount, a Redis, a bucket):
    # without a cluster key, whoever can write it decides what is served.
    shared_medium: ClassVar[bool] = False

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
        self.on_removed: Callable[[str, list[bytes]], None] | None = None

    def _removed(self, digests: Sequence[bytes]) -> None:
        """Tell the listener (if any) that these objects left the tier."""
        listener = self.on_removed
        if listener is not None and digests:
            listener(self.name, list(digests))

    def _removed_names(self, names: Sequence[str | bytes]) -> None:
        """``_removed`` for objects named by a name that ends in their
        digest's 64 hex digits (Redis keys, S3 object names)."""
        if self.on_removed is None:
            return
        digests = []
        for n in names:
            tail = (n.decode("ascii", "replace") if isinstance(n, bytes) else n)[-64:]
            try:
                digests.append(bytes.fromhex(tail))
            except ValueError:
                continue  # not an object name of kvtier's
        self._removed(digests)

    @abc.abstractmethod
    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int: ...

    @abc.abstractmethod
    def fetch(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> Iterator[ChunkObject]: ...

    @abc.abstractmethod
    def store(self, objs: Sequence[ChunkObject]) -> int: ...

    def store_async(self, objs: Sequence[ChunkObject]) -> "Future[int]":
        """``store(objs)`` in the background: the store's write-through. The
        objects stay valid until the future is done (the caller holds a
        reference each). This default stores at once on the caller's thread
        and returns a finished future; tiers with a pool of their own run it
        there (``PooledTier``)."""
        fut: Future[int] = Future()
        try:
            fut.set_result(self.store(objs))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def done_with(self, obj: ChunkObject) -> None:
        """The consumer of ``fetch`` is done with ``obj``: by default the
        object was handed over with its reference, released here."""
        obj.release()

    @abc.abstractmethod
    def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def load(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview] | LoadBuffers,
             timeout: float | None = None) -> int:
        """Load the leading payloads into ``bufs`` (each exactly a payload
        long; or lent ``LoadBuffers``).

        A buffer whose size does not match the stored payload ends the prefix.
        A tier with ``fetch_into`` copies where it verifies (or reads lent
        buffers in place).
        """
        n = 0
        views = load_views(bufs, len(keys))
        into = callable(getattr(self, "fetch_into", None))  # FetchInto, without the slow protocol check
        it = self.fetch_into(keys[: len(views)], views, timeout) if into else self.fetch(keys[: len(views)], timeout)
        try:
            for obj in it:
                try:
                    if not into:
                        dst = slot(views, n, obj.header.payload_len)
                        if dst is None:
                            break
                        copy_into(dst, obj.payload)
                    n += 1
                finally:
                    self.done_with(obj)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@runtime_checkable
class Maintenance(Protocol):
    """Optional maintenance of a tier (tests, benchmarks, administration):
    ``isinstance(tier, Maintenance)`` tells whether a tier has it. The memory,
    node-memory and directory tiers do; the network tiers do not."""

    def clear(self) -> int:
        """Remove the objects this tier may remove on its own; how many."""
        ...

    def drop_cache(self) -> int:
        """Drop this tier's objects from the OS page cache so that the next
        reads are cold; how many objects (0 where the tier is memory)."""
        ...


@runtime_checkable
class FetchInto(Protocol):
    """Optional: ``fetch`` that fills the caller's buffers itself
    (``PooledTier``: the directory, Redis and S3 tiers). ``TieredStore.load``
    uses it where a tier has it, and copies itself elsewhere."""

    def fetch_into(self, keys: Sequence[ChunkKey], bufs: Sequence[memoryview] | LoadBuffers,
                   timeout: float | None = None) -> Iterator[ChunkObject]:
        """``fetch``, each object's payload in its buffer of ``bufs``
        (unsigned bytes, one payload long each) before it is yielded; a buffer
        of another size ends the fetch there. Nothing writes into the
        caller's own ``bufs`` once the iterator is closed; lent ``bufs``
        (``LoadBuffers``) may be read into in place, a late read landing in
        a slot the next load does not reuse."""
        ...
