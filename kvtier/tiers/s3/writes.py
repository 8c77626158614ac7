"""The S3 tier's writes and deletes: a batch written in parallel, each
object checked first (a HEAD, or this process's recent access) and put with
``If-None-Match: *`` where the server takes it; a background collection
pass started when one is due. A part of ``S3Tier`` (``tier``), which owns
the state."""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

from kvtier.codec import ChunkObject, key_of
from kvtier.concurrency.executor import DELETE, MAINTENANCE, STORE
from kvtier.keys import ChunkKey
from kvtier.tiers.s3 import lease as s3lease
from kvtier.tiers.s3.client import brief, log_failure

log = logging.getLogger(__name__)


class S3Writes:
    """The writes and deletes of ``S3Tier``."""

    def store(self, objs: Sequence[ChunkObject]) -> int:
        """Write objects (callers run this on the pool via ``store_async``, or
        on their own thread) and return how many leading ones are held.

        The objects of a batch are written in parallel: all but the first are
        offered to the pool, the calling thread writes the first and then
        every offer no worker has taken yet (so a batch never waits for a
        worker, and a pool full of ``store`` jobs cannot deadlock). A chunk
        written behind a failed one is harmless: lookups stop at the gap and
        the collector removes it in time."""
        if not objs:
            return 0
        if not self.breaker.allow():
            self.metrics.dropped("breaker_open", len(objs))
            return 0
        offers = []
        for obj in objs[1:]:
            try:
                offers.append((obj, self.executor.submit(STORE, self._store_one, obj)))
            except RuntimeError:  # closing: write it here
                offers.append((obj, None))
        ok = [self._store_one(objs[0])]
        for obj, fut in offers:
            if fut is None or fut.cancel():
                ok.append(self._store_one(obj))
            else:
                ok.append(fut.result())  # bounded by the client's timeouts
        # Recency follows batch order (writes finish in any order): a batch
        # larger than capacity keeps its tail.
        now = time.time()
        for i, (obj, done) in enumerate(zip(objs, ok)):
            if done:
                self._stamp(self._name_of(obj), now + i * 1e-6)
        n = ok.index(False) if False in ok else len(ok)
        self.metrics.dropped("error", ok.count(False))
        return n

    def _name_of(self, obj: ChunkObject) -> str:
        return self.object_name(key_of(obj))

    def _known(self, name: str) -> bool:
        """This process wrote or read ``name`` within ``known_ttl_s``."""
        with self._lock:
            seen = self._access.get(name)
        return seen is not None and time.time() - seen < self.config.known_ttl_s

    def _store_one(self, obj: ChunkObject) -> bool:
        name = self._name_of(obj)
        t0 = time.perf_counter()
        try:
            if self._known(name) or self._head(name) is not None:
                self._skipped()
                return True
            if not self._put(name, obj):
                self._skipped()  # another writer published it meanwhile
                return True
        except self._backend_errors as exc:
            log.warning("tier %s: write failed (%s); chunk dropped", self.name, brief(exc))
            self._guard(False, "store")
            return False
        self._guard(True, "store")
        self.metrics.wrote(obj.nbytes)
        self.metrics.observe("write", time.perf_counter() - t0)
        self._stored(obj.nbytes)
        return True

    def _skipped(self) -> None:
        self._guard(True, "store")
        self.metrics.skipped()

    def _put(self, name: str, obj: ChunkObject) -> bool:
        """One atomic PUT; False if the object already exists (conditional put)."""
        body = bytes(obj.buf)  # botocore wants bytes or a file; a copy is cheap next to the upload
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": name, "Body": body, "ContentType": "application/octet-stream"}
        if self._conditional_put:
            try:
                self._client().put_object(IfNoneMatch="*", **kw)
                return True
            except self._errors.ClientError as exc:
                status = s3lease.http_status(exc)
                if status in (412, 409):  # exists / a concurrent conditional write won
                    return False
                if status not in (400, 501) or s3lease.error_code(exc) in ("AccessDenied", "NoSuchBucket"):
                    raise
                # The server does not take If-None-Match on PUT: check-then-put
                # from now on (a duplicate write publishes identical bytes).
                log.info("tier %s: server refuses conditional puts (%s); using plain puts", self.name, s3lease.error_code(exc))
                self._conditional_put = False
        self._client().put_object(**kw)
        return True

    def _stored(self, nbytes: int) -> None:
        """Count our write; start a background collection pass when one is due:
        the first write after start (it also measures usage), every
        ``gc_interval_s``, and sooner (at most every 5 s) once this instance's
        view of usage passes the high watermark."""
        with self._lock:
            self._used_estimate += nbytes
            self._objects_estimate += 1
            used = self._used_estimate
        due = self._trigger.due(used)
        self.metrics.used(used)
        if due:
            try:
                fut = self.executor.submit(MAINTENANCE, self._auto_gc)
            except RuntimeError:  # closing: the next instance collects
                self._trigger.cancel()
                return
            fut.add_done_callback(log_failure(self.name, "collection"))

    def _auto_gc(self) -> None:
        try:
            self.gc()
        finally:
            self._trigger.done()

    # ------------------------------------------------------------ delete
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self.delete_names([self.object_name(k) for k in keys])

    def delete_names(self, names: Sequence[str]) -> int:
        """Delete objects by name, as ``delete`` does (``kvtier store verify``
        deletes bad objects whose header may name no key at all)."""
        if not names:
            return 0
        return self.executor.submit(DELETE, self._delete_now, list(names)).result()

    def _delete_now(self, names: Sequence[str]) -> int:
        n = freed = 0
        for name in names:
            size = self._delete_name(name)
            if size:
                n += 1
                freed += size
        self._forget_bytes(n, freed)
        return n

    def _delete_name(self, name: str) -> int:
        """Delete one object; returns the bytes freed (0 if it was not there
        or the store could not be reached: counted, never raised)."""
        try:
            head = self._head(name)
            if head is None:
                return 0
            self._client().delete_object(Bucket=self.bucket, Key=name)
        except self._backend_errors as exc:
            log.warning("tier %s: delete failed: %s", self.name, brief(exc))
            self._guard(False, "delete")
            return 0
        with self._lock:
            self._access.pop(name, None)
        self._removed_names([name])
        return head[0]

    def _forget_bytes(self, n: int, freed: int) -> None:
        with self._lock:
            self._used_estimate = max(0, self._used_estimate - freed)
            self._objects_estimate = max(0, self._objects_estimate - n)
            used = self._used_estimate
        self.metrics.used(used)
