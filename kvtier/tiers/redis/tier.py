"""Redis/Valkey tier: one Redis string per chunk, on one server or a cluster.

Names (only hex digests; no token, model or tenant text)::

    <key_prefix><ns:16 hex>:<key:64 hex>     the encoded chunk object
    {<key_prefix>idx}:lru                    sorted set: object name -> access sequence
    {<key_prefix>idx}:size                   hash: object name -> bytes
    {<key_prefix>idx}:used                   bytes accounted
    {<key_prefix>idx}:seq                    access counter (scores of ``lru``)

- Atomic publication: each object is written by one ``SET``; a reader gets the
  whole value or nothing. Reads verify it (``codec.decode``); a bad value is a
  miss, counted, and deleted.
- Check before write: ``EXISTS`` (pipelined) first, so an object another
  instance already published costs no upload.
- Capacity: kvtier keeps its own byte budget per ``key_prefix`` (shared by
  every instance that uses the prefix) in the index keys above. A Lua script
  admits a batch atomically: it adds the new names, pops the least recently
  used names until the budget holds, and returns them; the client deletes
  those objects, then writes the new ones. Reads bump the access sequence.
  The index keys share one hash tag, so in a cluster they live in one slot and
  the scripts stay atomic; objects carry no hash tag and spread over all slots.
  The index can only over-count (a name whose object Redis evicted or expired
  stays accounted until it ages out of the LRU end), so kvtier never holds more
  than ``capacity``, except for victims of a client that died between the
  script and its deletes: ``ttl_s`` or Redis' own ``maxmemory`` policy (the
  operator's backstop, see docs/deploy.md) reclaims those.
- TLS (``tls``, or a ``rediss://`` URL): the ``tls`` module, the same settings
  for redis-py's connections and the read path's.
- Trouble: socket timeouts on every call, no client-side retries (the breaker
  and recompute are the retry), a circuit breaker around every operation.

Threads: reads, lookups, stores and deletes run on this tier's own
``PriorityExecutor``; the client (and, for a cluster, its slot map) is made
on first use, never in the constructor, so a server that is down at start
degrades like one that fails later.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Sequence

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from kvtier.buffers import align_up
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD, ChunkObject, decode, key_of
from kvtier.concurrency.executor import DELETE, LOAD, PriorityExecutor
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.pooled import PooledTier
from kvtier.tiers.redis import scripts, tls as redis_tls
from kvtier.tiers.redis.config import RedisConfig
from kvtier.tiers.redis.readpool import ReadPool, Redirected

log = logging.getLogger(__name__)

_MAX_VALUE = HEADER_BLOCK + MAX_PAYLOAD  # longer is not a chunk object: never read
# What storage trouble looks like: redis-py's errors (the cluster client's
# slot-map failures are not RedisErrors) and socket errors.
_TROUBLE = (RedisError, RedisClusterException, OSError)


class RedisTier(PooledTier):
    kind = "redis"
    shared_medium = True
    Config = RedisConfig

    def __init__(self, config: RedisConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self.executor = PriorityExecutor(self.name, config.io_threads, on_cpu=self.metrics.job_cpu)
        tag = "{" + config.key_prefix + "idx}"
        self._lru, self._size, self._seq, self._used = (f"{tag}:{s}" for s in ("lru", "size", "seq", "used"))
        self._client_lock = threading.Lock()
        self._client: Any = None
        # GETs go through connections of their own (one per pool thread at
        # most): values straight into pooled buffers.
        self._reads = ReadPool(config, max_idle=config.io_threads)
        self._scripts: dict[str, Any] = {}
        self._closed = False
        self._last_stats = (0, 0)  # objects, bytes: answered while the server is unreachable

    # ------------------------------------------------------------ client
    def _redis(self):
        """The client, made on first use (a cluster client maps slots then)."""
        with self._client_lock:
            if self._closed:
                raise RedisError("tier is closed")
            if self._client is None:
                self._client = self._connect()
                self._scripts = {
                    n: self._client.register_script(s) for n, s in (("admit", scripts.ADMIT), ("touch", scripts.TOUCH), ("forget", scripts.FORGET))
                }
            return self._client

    def _connect(self):
        c = self.config
        common: dict[str, Any] = dict(
            username=c.username or None,
            password=c.password or None,
            socket_timeout=c.socket_timeout_s,
            socket_connect_timeout=c.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),  # no hidden retries: the breaker and recompute are ours
        )
        if c.tls:
            common.update(redis_tls.client_kwargs(c))
        if c.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            nodes = [ClusterNode(h, p) for h, p in c.nodes()]  # type: ignore[misc]
            return RedisCluster(startup_nodes=nodes, ssl=c.tls, max_connections=c.pool_size, **common)
        host, port = c.nodes()[0]  # type: ignore[misc]
        pool = redis.BlockingConnectionPool(
            host=host,
            port=port,
            db=c.db,
            max_connections=c.pool_size,
            timeout=c.connect_timeout_s,  # wait for a free connection at most this long
            connection_class=redis.SSLConnection if c.tls else redis.Connection,
            **common,
        )
        return redis.Redis(connection_pool=pool)

    def _name(self, key: ChunkKey) -> bytes:
        return f"{self.config.key_prefix}{key.ns[:8].hex()}:{key.digest.hex()}".encode()

    def object_name(self, key: ChunkKey) -> bytes:
        """The Redis key that holds ``key``'s object."""
        return self._name(key)

    def servers_of(self, keys: Sequence[ChunkKey]) -> list[tuple[str, int, bytes]]:
        """(host, port, object name) for each server that holds one of
        ``keys``' objects, with the first such name: the single server, or
        each cluster master that serves a slot of one (tools that measure
        the servers, e.g. ``kvtier bench storage``). Raises for trouble."""
        client = self._redis()
        if not self.config.cluster:
            host, port = self.config.nodes()[0]  # type: ignore[misc]
            return [(host, port, self._name(keys[0]))] if keys else []
        out: dict[tuple[str, int], bytes] = {}
        for k in keys:
            name = self._name(k)
            node = client.get_node_from_key(name)
            out.setdefault((node.host, node.port), name)
        return [(h, p, n) for (h, p), n in out.items()]

    # ------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int:
        """One pipelined ``EXISTS`` per key (one round trip per server); the
        answer is the leading run of hits."""
        if not keys or not self.breaker.allow():
            return 0
        t0 = time.perf_counter()
        fut = self.executor.submit(LOAD, self._exists_all, [self._name(k) for k in keys])
        try:
            found = fut.result(timeout)
            ok = True
        except FutureTimeout:
            fut.cancel()
            log.warning("tier %s: lookup timed out after %.1fs; treating as a miss", self.name, timeout)
            found, ok = [], False
        except _TROUBLE as exc:
            log.warning("tier %s: lookup failed (%s); treating as a miss", self.name, exc)
            found, ok = [], False
        self._guard(ok, "lookup")
        self.metrics.observe("lookup", time.perf_counter() - t0)
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def _exists(self, key: ChunkKey) -> bool:
        return self._exists_all([self._name(key)])[0]

    def _exists_all(self, names: Sequence[bytes]) -> list[bool]:
        pipe = self._redis().pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(x) for x in pipe.execute()]

    # ------------------------------------------------------------ fetch
    def _served(self, keys: Sequence[ChunkKey]) -> None:
        self._touch([self._name(k) for k in keys])

    def _touch(self, names: list[bytes]) -> None:
        """Record the reads in the access index (one script call per fetch)."""
        try:
            client = self._redis()
            self._scripts["touch"](keys=[self._lru, self._seq], args=names, client=client)
        except _TROUBLE as exc:
            log.warning("tier %s: access stamp failed (%s)", self.name, exc)
            self.metrics.error("touch")

    def _read_one(self, key: ChunkKey) -> ChunkObject | None:
        """GET and verify one object into a pooled buffer (runs on the pool):
        the value is received straight into the buffer (``readpool``).
        Raises RedisError or OSError for trouble; the stream ends there."""
        t0 = time.perf_counter()
        name = self._name(key)
        ttl = self.config.ttl_s
        try:
            got = self._get_into(name, int(ttl * 1000) if ttl else None)
            if got is None:
                return None
            buf, n = got
            try:
                if n < HEADER_BLOCK:
                    raise CorruptObject(f"value size {n} out of range")
                obj = decode(buf, key, n, self.pool)
                if obj.header.object_len != n:
                    raise CorruptObject(f"value is {n} B, the object {obj.header.object_len} B")
            except BaseException:
                self.pool.put(buf)
                raise
        except CorruptObject as exc:
            log.warning("tier %s: object %s failed verification (%s); deleted", self.name, key.hex[:16], exc)
            self.metrics.corrupt()
            # Its index entry stays and ages out like any stale name (see above).
            self._redis().delete(name)
            self._removed([key.digest])
            return None
        self._bytes_per_token = max(1, n // max(1, key.num_tokens))
        self.metrics.observe("read", time.perf_counter() - t0)
        return obj

    def _get_into(self, name: bytes, px: int | None) -> tuple[memoryview, int] | None:
        """The value of ``name`` in a pooled buffer (aligned size) and its
        length, or None. On a cluster, the node is the one redis-py's slot
        map names; a node that answers MOVED/ASK (the slots moved) gets the
        read through redis-py, which follows the redirection and updates its
        map, then the value is copied into a pooled buffer (rare)."""
        if not self.config.cluster:
            host, port = self.config.nodes()[0]  # type: ignore[misc]
            return self._reads.get_into(host, port, name, self.pool, _MAX_VALUE, px)
        client = self._redis()
        node = client.get_node_from_key(name)
        try:
            return self._reads.get_into(node.host, node.port, name, self.pool, _MAX_VALUE, px)
        except Redirected:
            value = client.getex(name, px=px) if px else client.get(name)
            if value is None:
                return None
            n = len(value)
            if n > _MAX_VALUE:
                raise CorruptObject(f"value size {n} out of range") from None
            buf = self.pool.get(align_up(n))
            buf[:n] = value
            return buf, n

    # ------------------------------------------------------------ store
    def store(self, objs: Sequence[ChunkObject]) -> int:
        """Admit, evict, write (synchronous; ``store_async`` runs it on the
        pool). Returns how many leading objects were admitted and written."""
        if not objs:
            return 0
        if not self.breaker.allow():
            self.metrics.dropped("breaker_open", len(objs))
            return 0
        t0 = time.perf_counter()
        try:
            n = self._store(objs)
        except _TROUBLE as exc:
            log.warning("tier %s: store failed (%s); %d chunks dropped", self.name, exc, len(objs))
            self._guard(False, "store")
            self.metrics.dropped("error", len(objs))
            return 0
        self._guard(True, "store")
        self.metrics.observe("write", time.perf_counter() - t0)
        if n < len(objs):
            self.metrics.dropped("capacity", len(objs) - n)
        return n

    def _store(self, objs: Sequence[ChunkObject]) -> int:
        client = self._redis()
        names = [self._name(key_of(o)) for o in objs]
        exists = self._exists_all(names)
        args: list[Any] = [self.capacity]
        for name, obj in zip(names, objs):
            args += [name, obj.nbytes]
        status, victims, used, count = self._scripts["admit"](
            keys=[self._lru, self._size, self._seq, self._used], args=args, client=client
        )
        self._last_stats = (int(count), int(used))
        self.metrics.used(int(used))
        admitted = len(status)
        gone = set(victims)
        pipe = client.pipeline(transaction=False)
        for v in victims:  # first make room, then write: usage never passes capacity
            pipe.delete(v)
        if victims:
            pipe.execute()
            self.metrics.evicted(len(victims))
            self._removed_names(victims)
        ttl_ms = int(self.config.ttl_s * 1000) if self.config.ttl_s else None
        wrote: list[ChunkObject] = []
        for name, obj, there in zip(names[:admitted], objs[:admitted], exists[:admitted]):
            if there:
                self.metrics.skipped()
                if ttl_ms:
                    pipe.pexpire(name, ttl_ms)
            elif name not in gone:  # not already evicted by a later object of this batch
                pipe.set(name, obj.buf, px=ttl_ms)  # one atomic SET of the whole object
                wrote.append(obj)
        pipe.execute()
        for obj in wrote:
            self.metrics.wrote(obj.nbytes)
        return admitted

    # ------------------------------------------------------------ delete, stats
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self._delete_job(self._delete_now, keys)

    def delete_names(self, names: Sequence[bytes]) -> int:
        """``delete`` by object name, for tools that walk the index and hold
        names, not keys (``redis_verify``): unindexed and deleted alike."""
        return self._delete_job(self._delete_names, list(names))

    def _delete_job(self, job, what: Sequence) -> int:
        """``job(what)`` on the tier's pool, behind its breaker: how many went."""
        if not what or not self.breaker.allow():
            return 0
        try:
            n = self.executor.submit(DELETE, job, what).result()
        except _TROUBLE as exc:
            log.warning("tier %s: delete failed (%s)", self.name, exc)
            self._guard(False, "delete")
            return 0
        self._guard(True, "delete")
        return n

    def index(self) -> tuple[Any, str]:
        """The tier's client (made on first use; raises for trouble) and the
        name of its index sorted set, which holds every object's name: for
        tools that walk the objects (``redis_verify``)."""
        return self._redis(), self._lru

    def _delete_now(self, keys: Sequence[ChunkKey]) -> int:
        return self._delete_names([self._name(k) for k in keys])

    def _delete_names(self, names: list[bytes]) -> int:
        # Unindex first, then delete: a concurrent store of the same key that
        # lands in between re-indexes it, so an object never outlives its
        # index entry (which would hide bytes from the budget).
        client = self._redis()
        used, count = self._scripts["forget"](keys=[self._lru, self._size, self._used], args=names, client=client)
        self._last_stats = (int(count), int(used))
        self.metrics.used(int(used))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.delete(name)
        n = sum(int(x) for x in pipe.execute())
        self._removed_names(names)  # none of them is in the tier now
        return n

    def stats(self) -> TierStats:
        """Usage of the whole prefix (every instance's objects), from the
        index; the last known figures while the server is unreachable."""
        if self.breaker.allow():
            try:
                pipe = self._redis().pipeline(transaction=False)
                pipe.zcard(self._lru)
                pipe.get(self._used)
                count, used = pipe.execute()
                self._last_stats = (int(count), int(used or 0))
                self.breaker.record(True)
            except _TROUBLE as exc:
                log.warning("tier %s: stats failed (%s)", self.name, exc)
                self._guard(False, "stats")
        objects, used = self._last_stats
        return TierStats(self.name, self.kind, objects, used, self.capacity)

    def close(self) -> None:
        self.executor.close()
        self._reads.close()
        with self._client_lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
