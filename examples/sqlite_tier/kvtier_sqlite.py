"""A kvtier tier kept in one SQLite database file: the worked example of a tier
that lives outside kvtier (docs/architecture.md, "Adding a tier kind").

It stands for any storage a user has and kvtier does not ship (a vendor's
file system client, an in-house key-value store): one class on
``kvtier.tiers.base.Tier`` with its config dataclass as ``Config``, found
through the registry without editing kvtier, either

- installed: ``pip install ./examples/sqlite_tier`` declares the kind
  ``sqlite`` in the ``kvtier.tiers`` entry-point group, so a config says
  ``{kind: sqlite, path: /var/kv/kv.db, capacity: 20GiB}`` or
  ``KVTIER_TIERS=sqlite:///var/kv/kv.db?capacity=20GiB``; or
- by import path, with this file on ``PYTHONPATH``:
  ``{kind: "kvtier_sqlite:SqliteTier", path: ..., capacity: ...}``.

kvtier's contract suite runs over it (``tests/tiers/harness_sqlite.py``).

What the contract asks, and how this tier answers:

- lookup: how many leading keys are held (a primary-key probe each);
- fetch: the leading objects, each read into a buffer of the tier's pool and
  verified by ``kvtier.codec.decode`` against the key asked for; handed over
  with their reference (``persistent``: the consumer releases them). A row
  that fails verification is a miss, counted (``metrics.corrupt``) and
  removed: bad data is never served twice;
- store: how many leading objects are now held; one already there is
  skipped and counted; room is made by evicting the least recently used
  rows (``seq``: a counter every store and read advances), and an object
  larger than the whole capacity is refused and counted;
- capacity: bytes of objects, never exceeded; ``stats`` and the
  ``used_bytes`` gauge follow every change;
- storage trouble (``sqlite3.Error``: locked, full, damaged file) is never
  raised: counted as an error, and answered with a shorter prefix;
- threads: callers' threads run lookups and reads (one connection, one lock
  around each statement, never held while a consumer has an object); the
  engine's write-through runs on the tier's own ``PriorityExecutor``
  (``store_async``), whose thread starts on first use and is joined by
  ``close``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from kvtier.codec import ChunkObject, decode
from kvtier.config import ConfigError, opt, size_field
from kvtier.concurrency.executor import STORE, PriorityExecutor
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.base import Tier, TierStats

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    digest BLOB PRIMARY KEY,   -- the chunk key's digest
    data   BLOB NOT NULL,      -- the whole encoded object (header + payload)
    size   INTEGER NOT NULL,
    seq    INTEGER NOT NULL    -- recency: larger is more recent
);
CREATE INDEX IF NOT EXISTS objects_by_seq ON objects (seq);
"""


@dataclass(frozen=True)
class SqliteConfig:
    path: str = opt("", "SQLite database file (created if missing)")
    capacity: int = size_field(0, "bytes of objects this tier may hold (required)")
    name: str = opt("sqlite", "tier name in metrics and logs")
    busy_timeout_s: float = opt(5.0, "how long a statement waits for another process's lock on the file", ge=0)

    def validate(self, prefix: str = "") -> None:
        if not self.path:
            raise ConfigError(f"{prefix}path", "is required", "set the database file, e.g. path: /var/kv/kv.db")
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set", "set how much this tier may hold, e.g. capacity: 20GiB")


class SqliteTier(Tier):
    kind = "sqlite"
    Config = SqliteConfig
    url_location = "path"  # sqlite:///var/kv/kv.db?capacity=20GiB fills path

    def __init__(self, config: SqliteConfig, metrics=None, breaker=None, pool=None):
        super().__init__(config, metrics, breaker, pool)
        self.capacity = config.capacity
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(config.path, timeout=config.busy_timeout_s, check_same_thread=False,
                                       isolation_level=None)  # autocommit: each statement is its own transaction
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._seq, self._used, objects = self._db.execute(
                "SELECT COALESCE(MAX(seq), 0), COALESCE(SUM(size), 0), COUNT(*) FROM objects").fetchone()
        except sqlite3.Error as exc:
            raise ConfigError(f"{config.name}.path", f"{config.path} is not a usable SQLite database ({exc})",
                              "point it at a writable file this user owns") from None
        self.executor = PriorityExecutor(self.name, 1)  # SQLite writes one at a time anyway
        self.metrics.used(self._used)

    # ------------------------------------------------------------ contract
    def lookup(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> int:
        with self._lock:
            try:
                for i, k in enumerate(keys):
                    if self._db.execute("SELECT 1 FROM objects WHERE digest = ?", (k.digest,)).fetchone() is None:
                        return i
            except sqlite3.Error as exc:
                self._trouble("lookup", exc)
                return i
        return len(keys)

    def fetch(self, keys: Sequence[ChunkKey], timeout: float | None = None) -> Iterator[ChunkObject]:
        served = 0
        try:
            for key in keys:
                obj = self._read(key)
                if obj is None:
                    break
                yield obj  # handed over with its reference: the consumer releases it
                served += 1
                self.metrics.hit(1, obj.header.num_tokens, obj.nbytes)
        finally:
            self.metrics.miss(len(keys) - served)

    def _read(self, key: ChunkKey) -> ChunkObject | None:
        t0 = time.perf_counter()
        with self._lock:
            try:
                row = self._db.execute("SELECT data FROM objects WHERE digest = ?", (key.digest,)).fetchone()
                if row is not None:
                    self._seq += 1
                    self._db.execute("UPDATE objects SET seq = ? WHERE digest = ?", (self._seq, key.digest))
            except sqlite3.Error as exc:
                self._trouble("read", exc)
                return None
        if row is None:
            return None
        data = row[0]
        buf = self.pool.get(len(data))
        buf[: len(data)] = data
        try:
            obj = decode(buf, key, len(data), self.pool)
        except CorruptObject as exc:
            self.pool.put(buf)
            log.warning("tier %s: object %s failed verification (%s); removed", self.name, key.hex[:16], exc)
            self.metrics.corrupt()
            self._remove([key])
            return None
        self.metrics.observe("read", time.perf_counter() - t0)
        return obj

    def store(self, objs: Sequence[ChunkObject]) -> int:
        for n, obj in enumerate(objs):
            ok, reason = self._put(obj)
            if not ok:
                self.metrics.dropped(reason, len(objs) - n)
                return n
        return len(objs)

    def store_async(self, objs: Sequence[ChunkObject]):
        """Write-through from the engine: ``store`` on this tier's thread."""
        return self.executor.submit(STORE, self.store, objs)

    def _put(self, obj: ChunkObject) -> tuple[bool, str]:
        size, digest = obj.nbytes, obj.header.key
        if size > self.capacity:
            return False, "capacity"
        t0 = time.perf_counter()
        evicted: list[bytes] = []
        with self._lock:
            try:
                self._seq += 1
                if self._db.execute("UPDATE objects SET seq = ? WHERE digest = ?", (self._seq, digest)).rowcount:
                    self.metrics.skipped()
                    return True, ""
                while self._used + size > self.capacity:
                    victim = self._db.execute("SELECT digest, size FROM objects ORDER BY seq LIMIT 1").fetchone()
                    self._db.execute("DELETE FROM objects WHERE digest = ?", (victim[0],))
                    self._used -= victim[1]
                    evicted.append(bytes(victim[0]))
                self._db.execute("INSERT INTO objects (digest, data, size, seq) VALUES (?, ?, ?, ?)",
                                 (digest, obj.buf, size, self._seq))
                self._used += size
            except sqlite3.Error as exc:
                self._trouble("store", exc)
                return False, "error"
            finally:
                used = self._used
                if evicted:
                    self.metrics.evicted(len(evicted))
                self.metrics.used(used)
        self._removed(evicted)  # tell a listener (KV events), outside the lock
        self.metrics.wrote(size)
        self.metrics.observe("write", time.perf_counter() - t0)
        return True, ""

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self._remove(keys)

    def _remove(self, keys: Sequence[ChunkKey]) -> int:
        gone = []
        with self._lock:
            try:
                for k in keys:
                    row = self._db.execute("DELETE FROM objects WHERE digest = ? RETURNING size", (k.digest,)).fetchone()
                    if row is not None:
                        self._used -= row[0]
                        gone.append(k.digest)
            except sqlite3.Error as exc:
                self._trouble("delete", exc)
            used = self._used
        self.metrics.used(used)
        self._removed(gone)
        return len(gone)

    def stats(self) -> TierStats:
        with self._lock:
            try:
                objects = self._db.execute("SELECT COUNT(*) FROM objects").fetchone()[0]
            except sqlite3.Error as exc:
                self._trouble("stats", exc)
                objects = 0
            return TierStats(self.name, self.kind, objects, self._used, self.capacity)

    def close(self) -> None:
        self.executor.close()  # finishes queued write-through, joins its thread
        with self._lock:
            self._db.close()  # a second close is a no-op

    def _trouble(self, op: str, exc: sqlite3.Error) -> None:
        log.warning("tier %s: %s failed (%s)", self.name, op, exc)
        self.metrics.error(op)
