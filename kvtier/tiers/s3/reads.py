"""The S3 tier's reads: lookups as HEADs, loads as GETs into pooled buffers
(as presigned plain HTTP requests where ``presigned`` can, else through
boto3), each object verified; a bad one is a miss, counted and deleted. A
hit refreshes the object's ``LastModified`` for other instances once it is
older than ``touch_interval_s``. A part of ``S3Tier`` (``tier``), which owns
the state."""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvtier.buffers import align_up
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD, ChunkObject, decode
from kvtier.concurrency.executor import MAINTENANCE
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.s3 import lease as s3lease, presigned
from kvtier.tiers.s3.client import brief, log_failure

log = logging.getLogger(__name__)


class S3Reads:
    """The reads of ``S3Tier``."""

    def _head(self, name: str) -> tuple[int, float] | None:
        """(size, LastModified) of an object, None if absent. Raises on trouble
        (``_backend_errors``)."""
        if self._http is not None:
            try:
                return self._http.head(self.bucket, name)
            except presigned.Unhandled:
                pass  # boto3 interprets the answer, with its retries
        try:
            r = self._client().head_object(Bucket=self.bucket, Key=name)
        except self._errors.ClientError as exc:
            if s3lease.http_status(exc) == 404:
                return None
            raise
        return int(r["ContentLength"]), r["LastModified"].timestamp()

    def _exists(self, key: ChunkKey) -> bool:
        head = self._head(self.object_name(key))
        return head is not None and head[0] >= HEADER_BLOCK

    def _describe(self, exc: BaseException) -> str:
        return brief(exc)

    def _read_one(self, key: ChunkKey) -> ChunkObject | None:
        """GET one object into a pooled buffer and verify it (a worker thread).
        Returns None for a miss or a bad object; raises for backend trouble."""
        name = self.object_name(key)
        t0 = time.perf_counter()
        if self._http is not None:
            try:
                got = self._http.get_into(self.bucket, name, self.pool, HEADER_BLOCK + MAX_PAYLOAD)
            except presigned.Unhandled:
                pass  # boto3 interprets the answer, with its retries: below
            except CorruptObject as exc:
                return self._bad(name, key, exc)
            else:
                if got is None:
                    return None
                buf, size, last_modified = got
                obj, err = self._verify(buf, size, key)
                if err is not None:
                    return self._bad(name, key, err)
                return self._good(obj, name, last_modified, t0)
        try:
            r = self._client().get_object(Bucket=self.bucket, Key=name)
        except self._errors.ClientError as exc:
            if s3lease.http_status(exc) == 404:
                return None
            raise
        body = r["Body"]
        try:
            size = int(r["ContentLength"])
            if size < HEADER_BLOCK or size > HEADER_BLOCK + MAX_PAYLOAD:
                obj = None
                err: CorruptObject | None = CorruptObject(f"object size {size} out of range")
            else:
                obj, err = self._read_body(body, size, key)
        finally:
            body.close()
        if err is not None:
            return self._bad(name, key, err)
        return self._good(obj, name, r["LastModified"].timestamp(), t0)

    def _bad(self, name: str, key: ChunkKey, err: CorruptObject) -> None:
        log.warning("tier %s: object %s failed verification (%s); deleted", self.name, key.hex[:16], err)
        self.metrics.corrupt()
        self._delete_name(name)
        return None

    def _good(self, obj: ChunkObject, name: str, last_modified: float, t0: float) -> ChunkObject:
        h = obj.header
        self._bytes_per_token = max(1, obj.nbytes // max(1, h.num_tokens))
        self.metrics.observe("read", time.perf_counter() - t0)
        self._touched(name, last_modified)
        return obj

    def _verify(self, buf: memoryview, size: int, key: ChunkKey) -> tuple[ChunkObject | None, CorruptObject | None]:
        """Decode an object read whole into ``buf`` (from the pool); on failure
        the buffer goes back to the pool."""

        def whole() -> int:
            if size < HEADER_BLOCK:
                raise CorruptObject(f"object size {size} out of range")
            return size

        return self._decode_pooled(buf, key, whole)

    def _read_body(self, body, size: int, key: ChunkKey) -> tuple[ChunkObject | None, CorruptObject | None]:
        """Read ``body`` (``size`` bytes announced) into a pooled buffer and
        decode it; a short body is decoded as far as it came (and fails)."""
        buf = self.pool.get(align_up(size))

        def fill() -> int:
            got = 0
            while got < size:
                n = body.readinto(buf[got:size])
                if not n:
                    break
                got += n
            return got

        return self._decode_pooled(buf, key, fill)

    def _decode_pooled(self, buf: memoryview, key: ChunkKey,
                       fill: Callable[[], int]) -> tuple[ChunkObject | None, CorruptObject | None]:
        """Decode the object ``fill()`` leaves in ``buf`` (a pool buffer; it
        returns the object's length). On any failure, in ``fill`` or in the
        decode, ``buf`` goes back to the pool: a CorruptObject is returned,
        anything else raised."""
        try:
            return decode(buf, key, fill(), self.pool), None
        except CorruptObject as exc:
            self.pool.put(buf)
            return None, exc
        except BaseException:
            self.pool.put(buf)
            raise

    def _touched(self, name: str, last_modified: float) -> None:
        """A hit: remember it here, and refresh LastModified for other
        instances when it is older than ``touch_interval_s`` (background)."""
        self._stamp(name)
        if time.time() - last_modified < self.config.touch_interval_s:
            return
        with self._lock:
            if name in self._touching:
                return
            self._touching.add(name)
        try:
            fut = self.executor.submit(MAINTENANCE, self._refresh, name)
        except RuntimeError:  # closing: the next hit refreshes it
            with self._lock:
                self._touching.discard(name)
            return
        fut.add_done_callback(log_failure(self.name, "recency refresh"))

    def _refresh(self, name: str) -> None:
        try:
            # A server-side copy onto itself (metadata replaced, as S3 asks
            # for a self-copy) gives the object a new LastModified; the copy
            # is atomic like a put. An object deleted meanwhile just fails.
            self._client().copy_object(
                Bucket=self.bucket,
                Key=name,
                CopySource={"Bucket": self.bucket, "Key": name},
                MetadataDirective="REPLACE",
                Metadata={"kvtier-touched": str(int(time.time()))},
            )
        except self._errors.ClientError as exc:
            if s3lease.http_status(exc) != 404:
                raise
        finally:
            with self._lock:
                self._touching.discard(name)
