"""S3 tier: one object per chunk in any S3-compatible store (AWS S3, SeaweedFS,
MinIO, Ceph RGW, ...), through boto3.

Names: ``PREFIX/kvtier-v1/<ns:16 hex>/<key:64 hex>``. Only hex digests: no
token, model or tenant text ever appears in a name. The body is the encoded
``ChunkObject`` (same codec as the file tiers), verified on every read.

- Publication: a PUT is atomic in S3, so readers see no object or a whole one.
  Before writing, a HEAD checks whether another instance already published the
  object (spares the upload); the PUT itself carries ``If-None-Match: *``
  where the server supports it (AWS since 2024, SeaweedFS 4.x), so of two
  racing writers only one publishes and counts it. Servers that reject the
  header get plain PUTs from then on: content addressing makes a duplicate
  PUT harmless (same bytes).
- Reads: lookups are parallel HEADs on this tier's pool under a deadline;
  loads are parallel GETs in the byte-budgeted read window of the file tiers
  (``ReadStream``), each body read straight into a pooled buffer. Both go as
  plain HTTP requests to URLs this tier's boto3 client presigns (``s3_http``:
  half the client CPU of boto3's own calls); any answer but 200 or 404 is
  repeated through boto3. A bad object is a miss, is counted as an integrity
  failure, and is deleted.
- Failure: every call has connect and read timeouts and at most
  ``max_attempts`` tries (botocore's standard retry mode: exponential backoff
  with jitter). Callers wait no longer than their own deadline; the circuit
  breaker skips the tier after repeated failures. Nothing raises to the caller.
- Capacity (S3 has no atime and no cheap usage figure): a watermark collector
  (``gc``) lists the prefix, takes usage from the listing and deletes the least
  recently used objects once usage passes ``high_watermark``, down to
  ``low_watermark``. Recency is the later of the object's ``LastModified`` and
  this process's own last access to it (an in-process index of the most recent
  ``access_index_entries`` keys). So that other instances see hits too, a hit
  on an object whose ``LastModified`` is older than ``touch_interval_s``
  refreshes it by a server-side self-copy (in the background, at most once per
  interval per object). Any instance may collect; a lease object
  (``s3lease``: conditional PUTs) lets one pass run at a time per prefix, so
  two collectors never both delete. Still, let one or a few instances collect
  (``gc_interval_s: 0`` elsewhere): every pass lists the whole prefix.

Threads: every backend call runs on this tier's ``PriorityExecutor`` (loads
before deletes before stores before maintenance). The boto3 client is made in
the constructor (no network I/O) and is thread-safe; it is re-created in a
forked child, which must not share the parent's connections.

Size: about 700 lines, over the house's ~500. ``S3Config`` documents some
twenty options (~70 lines), and ``S3Tier`` owns state its parts share and
that no other tier has (the presigning client, the recency index, the
conditional-PUT fallback, the collection lease); what other tiers share
already lives elsewhere (``PooledTier``, ``ReadStream``, ``Collector``,
``s3_http``, ``s3lease``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from kvtier.buffers import align_up
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD, ChunkObject, decode, key_of
from kvtier.config import ConfigError, check_watermarks, opt, size_field
from kvtier.concurrency.executor import DELETE, MAINTENANCE, STORE, PriorityExecutor
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.s3 import lease as s3lease, presigned as s3_http
from kvtier.tiers.collector import Collector, GcResult, Trigger, WatermarkPolicy
from kvtier.tiers.dir.layout import LAYOUT_DIR
from kvtier.tiers.pooled import PooledTier

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:.*/)?" + LAYOUT_DIR + r"/([0-9a-f]{16})/([0-9a-f]{64})$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_PREFIX = re.compile(r"^[A-Za-z0-9._\-/]{0,512}$")
_NO_LEASE = s3lease.Lease("", "", float("inf"))  # collect without exclusion (server without conditional requests)


_KEYS_FIX = ("write it as scheme://host:port; set the keys in KVTIER_S3_ACCESS_KEY_ID and KVTIER_S3_SECRET_ACCESS_KEY "
             "(or boto3's AWS_* variables, profile, role), or access_key_id/secret_access_key in the config file")


def _secret(doc: str) -> Any:
    # Never shown by repr (so never in logs or error messages that print configs).
    return field(default=None, repr=False, metadata={"doc": doc})


@dataclass(frozen=True)
class S3Config:
    location: str = opt("", "BUCKET or BUCKET/PREFIX (required; the URL s3://BUCKET/PREFIX fills it)")
    capacity: int = size_field(0, "bytes this tier may hold under its prefix (required)")
    name: str = opt("s3", "tier name in metrics and logs")
    endpoint: str | None = opt(None, "endpoint URL, e.g. http://127.0.0.1:8333 (default: AWS S3)")
    region: str | None = opt(None, "region (default: boto3's configuration chain)")
    access_key_id: str | None = _secret("access key (default: boto3's credential chain: env, profile, instance role)")
    secret_access_key: str | None = _secret("secret key (default: boto3's credential chain); never logged")
    verify_tls: bool = opt(True, "verify the server's TLS certificate (https endpoints)")
    ca_bundle: str = opt("", "CA bundle file for TLS verification (default: certifi's)")
    addressing_style: str = opt("auto", "auto (path style for a custom endpoint, virtual hosts on AWS), path or virtual")
    connect_timeout_s: float = opt(1.0, "connect timeout of one request", gt=0)
    read_timeout_s: float = opt(5.0, "socket read timeout of one request", gt=0)
    max_attempts: int = opt(2, "tries per request, first included (backoff with jitter between them)", ge=1)
    io_threads: int = opt(16, "threads (and connections) of this tier's I/O pool", ge=1)
    read_window_bytes: int = size_field(64 << 20, "bytes of GETs in flight per load")
    create_bucket: bool = opt(False, "create the bucket at start if it does not exist")
    high_watermark: float = opt(0.95, "usage fraction of capacity that starts collection")
    low_watermark: float = opt(0.85, "usage fraction collection brings usage down to")
    touch_interval_s: float = opt(600.0, "a hit refreshes an object's LastModified (self-copy) once it is older than this", ge=0)
    gc_interval_s: float = opt(300.0, "seconds between automatic collection passes of this instance (0: never)", ge=0)
    gc_lease_s: float = opt(600.0, "a collection pass holds a lease this long: no other instance collects meanwhile", gt=0)
    access_index_entries: int = opt(100_000, "keys whose last access this process remembers for eviction order", ge=1)
    known_ttl_s: float = opt(30.0, "a store skips the existence check for objects this process wrote or read this recently", ge=0)

    @property
    def bucket(self) -> str:
        return self.location.strip("/").partition("/")[0]

    @property
    def prefix(self) -> str:
        """The key prefix, without slashes at either end ('' for none)."""
        return self.location.strip("/").partition("/")[2].strip("/")

    def validate(self, prefix: str = "") -> None:
        if not self.bucket:
            raise ConfigError(f"{prefix}location", "is required", "set BUCKET/PREFIX, e.g. s3://kvcache/prod")
        if not _BUCKET.match(self.bucket):
            raise ConfigError(
                f"{prefix}location", f"bucket name {self.bucket!r} is not valid", "use 3-63 lowercase letters, digits, dots or hyphens"
            )
        # Servers normalise or refuse such prefixes (SeaweedFS answers 400 to
        # every call): refuse them here, with the reason.
        parts = self.prefix.split("/") if self.prefix else []
        if any(p in ("", ".", "..") for p in parts) or not _PREFIX.match(self.prefix):
            raise ConfigError(
                f"{prefix}location", f"key prefix {self.prefix!r} is not valid",
                "use path segments of letters, digits and . _ - (no empty, '.' or '..' segments), e.g. kvcache/prod",
            )
        if self.capacity <= 0:
            raise ConfigError(f"{prefix}capacity", "must be set", "set how much this tier may hold, e.g. capacity: 1TiB")
        if self.io_threads <= 0:
            raise ConfigError(f"{prefix}io_threads", "must be positive", "use e.g. 16")
        if self.read_window_bytes <= 0:
            raise ConfigError(f"{prefix}read_window_bytes", "must be positive", "use e.g. 64MiB")
        if self.max_attempts < 1:
            raise ConfigError(f"{prefix}max_attempts", "must be at least 1", "use e.g. 2")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ConfigError(f"{prefix}read_timeout_s", "timeouts must be positive", "use e.g. connect 1, read 5")
        if self.addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError(f"{prefix}addressing_style", f"unknown style {self.addressing_style!r}", "use auto, path or virtual")
        if self.endpoint and "@" in urlsplit(self.endpoint).netloc:  # the message never repeats it: a secret
            raise ConfigError(f"{prefix}endpoint", "holds credentials (user:secret@ before the host)", _KEYS_FIX)
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                f"{prefix}secret_access_key", "set both access_key_id and secret_access_key, or neither", "or use boto3's credential chain"
            )
        if self.gc_lease_s < 2:
            raise ConfigError(f"{prefix}gc_lease_s", "must be at least 2 seconds", "use e.g. 600")
        check_watermarks(prefix, self.low_watermark, self.high_watermark)


class S3Tier(PooledTier):
    kind = "s3"
    shared_medium = True
    Config = S3Config

    def __init__(self, config: S3Config, metrics=None, breaker=None, pool=None):
        import botocore.exceptions  # boto3 is the `s3` extra: fail here, not at import of kvtier

        super().__init__(config, metrics, breaker, pool)
        self._errors = botocore.exceptions
        self._backend_errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, *s3_http.HTTP_ERRORS)
        self.bucket = config.bucket
        self.base = f"{config.prefix}/{LAYOUT_DIR}" if config.prefix else LAYOUT_DIR
        self.capacity = config.capacity
        self.executor = PriorityExecutor(self.name, config.io_threads, on_cpu=self.metrics.job_cpu)
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._client_pid = -1
        self._conditional_put = True  # until the server refuses If-None-Match
        self._access: OrderedDict[str, float] = OrderedDict()  # name -> wall time of our last access
        self._touching: set[str] = set()
        self._used_estimate = 0  # last listing + own writes and deletes since
        self._objects_estimate = 0
        self._no_lease = False  # the server refused conditional requests
        self._trigger = Trigger(WatermarkPolicy.of(config))
        self._collector: Collector[tuple[str, int, float]] = Collector(
            self.name, self._trigger.policy, _Leases(self), self.metrics,
            (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError))
        # GETs and HEADs as presigned plain HTTP requests (s3_http), unless a
        # proxy stands between us and the endpoint.
        self._http = (s3_http.PresignedHTTP(config, self._client, max_idle=config.io_threads + 8)
                      if s3_http.enabled(config.endpoint) else None)
        # Made now rather than by the first lookup: boto3's set-up (imports,
        # service model) costs 0.1-1 s of CPU, which a fresh engine's first
        # lookup would otherwise spend inside its deadline (and miss). It
        # does no network I/O, so a server down at start still only shows
        # as failing calls later.
        self._client()
        if config.create_bucket:
            self._create_bucket()

    # ------------------------------------------------------------ client
    def _client(self):
        with self._lock:
            if self._client_obj is None or self._client_pid != os.getpid():
                self._client_obj = self._make_client()
                self._client_pid = os.getpid()
            return self._client_obj

    def client(self):
        """The boto3 client (thread-safe; made anew in a forked child): for
        tools that measure the same store, e.g. ``kvtier bench storage``."""
        return self._client()

    def tls_context(self):
        """The TLS settings of this tier's plain HTTP reads (``s3_http``), for
        tools that measure the same store."""
        return s3_http.tls_context(self.config)

    def _make_client(self):
        import boto3
        from botocore.config import Config

        c = self.config
        style = c.addressing_style
        if style == "auto":
            style = "path" if c.endpoint else "auto"
        bc = Config(
            connect_timeout=c.connect_timeout_s,
            read_timeout=c.read_timeout_s,
            retries={"max_attempts": c.max_attempts, "mode": "standard"},
            # The pool's workers, plus callers that run ``store`` or ``gc``
            # on their own threads: no request waits for a connection.
            max_pool_connections=c.io_threads + 8,
            s3={"addressing_style": style},
            parameter_validation=False,  # our requests are fixed in code; saves CPU per call
            # Plain PUT bodies: many S3-compatible servers reject the
            # aws-chunked trailing checksums newer botocore sends by default.
            # Our codec checksums every object end to end anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        verify: bool | str = (c.ca_bundle or True) if c.verify_tls else False
        # A session per client: boto3's default session is not thread-safe.
        return boto3.session.Session().client(
            "s3",
            endpoint_url=c.endpoint or None,
            region_name=c.region or None,
            aws_access_key_id=c.access_key_id,
            aws_secret_access_key=c.secret_access_key,
            verify=verify,
            config=bc,
        )

    def _create_bucket(self) -> None:
        client = self._client()
        try:
            client.head_bucket(Bucket=self.bucket)
            return
        except self._errors.ClientError as exc:
            if s3lease.http_status(exc) not in (404, 400):
                log.warning("tier %s: cannot check bucket %s: %s", self.name, self.bucket, _brief(exc))
                return
        except self._errors.BotoCoreError as exc:
            log.warning("tier %s: cannot reach %s: %s", self.name, self.config.endpoint or "S3", exc)
            return
        try:
            kw: dict[str, Any] = {"Bucket": self.bucket}
            if self.config.region and self.config.region != "us-east-1":
                kw["CreateBucketConfiguration"] = {"LocationConstraint": self.config.region}
            client.create_bucket(**kw)
            log.info("tier %s: created bucket %s", self.name, self.bucket)
        except self._errors.ClientError as exc:
            if s3lease.error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                log.warning("tier %s: cannot create bucket %s: %s", self.name, self.bucket, _brief(exc))
        except self._errors.BotoCoreError as exc:
            log.warning("tier %s: cannot create bucket %s: %s", self.name, self.bucket, exc)

    # ------------------------------------------------------------ names
    def object_name(self, key: ChunkKey) -> str:
        return f"{self.base}/{key.ns[:8].hex()}/{key.digest.hex()}"

    # ------------------------------------------------------------ helpers
    def _stamp(self, name: str, when: float | None = None) -> None:
        with self._lock:
            self._access[name] = time.time() if when is None else when
            self._access.move_to_end(name)
            while len(self._access) > self.config.access_index_entries:
                self._access.popitem(last=False)

    def _head(self, name: str) -> tuple[int, float] | None:
        """(size, LastModified) of an object, None if absent. Raises on trouble
        (``_backend_errors``)."""
        if self._http is not None:
            try:
                return self._http.head(self.bucket, name)
            except s3_http.Unhandled:
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

    # ------------------------------------------------------------ fetch
    def _describe(self, exc: BaseException) -> str:
        return _brief(exc)

    def _read_one(self, key: ChunkKey) -> ChunkObject | None:
        """GET one object into a pooled buffer and verify it (a worker thread).
        Returns None for a miss or a bad object; raises for backend trouble."""
        name = self.object_name(key)
        t0 = time.perf_counter()
        if self._http is not None:
            try:
                got = self._http.get_into(self.bucket, name, self.pool, HEADER_BLOCK + MAX_PAYLOAD)
            except s3_http.Unhandled:
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
        fut.add_done_callback(_log_failure(self.name, "recency refresh"))

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

    # ------------------------------------------------------------ store
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
            log.warning("tier %s: write failed (%s); chunk dropped", self.name, _brief(exc))
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
            fut.add_done_callback(_log_failure(self.name, "collection"))

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
            log.warning("tier %s: delete failed: %s", self.name, _brief(exc))
            self._guard(False, "delete")
            return 0
        with self._lock:
            self._access.pop(name, None)
        return head[0]

    def _forget_bytes(self, n: int, freed: int) -> None:
        with self._lock:
            self._used_estimate = max(0, self._used_estimate - freed)
            self._objects_estimate = max(0, self._objects_estimate - n)
            used = self._used_estimate
        self.metrics.used(used)

    # ------------------------------------------------------------ gc
    def gc(self, dry_run: bool = False) -> GcResult:
        """One collection pass over the prefix (``Collector``; a worker or any
        caller thread). Returns ``ran=False`` (with a reason) if the store
        could not be listed or another collector holds the lease. A dry run
        takes no lease."""
        access: dict[str, float] = {}

        def listing() -> list[tuple[str, int, float]]:
            entries = self._list()
            with self._lock:
                access.update(self._access)
            return entries

        return self._collector.collect(listing, _entry_size, lambda e: max(e[2], access.get(e[0], 0.0)),
                                       self._gc_delete, dry_run, self._gc_finish(dry_run))

    def _collect(self, entries: list[tuple[str, int, float]], dry_run: bool, lease: s3lease.Lease | None, t0: float) -> GcResult:
        """The pass over listed ``entries`` under ``lease`` (taken by the caller)."""
        with self._lock:
            access = dict(self._access)
        return self._collector.sweep(entries, _entry_size, lambda e: max(e[2], access.get(e[0], 0.0)),
                                     self._gc_delete, lease, dry_run, self._gc_finish(dry_run), t0)

    def _gc_delete(self, entry: tuple[str, int, float]) -> bool:
        self._client().delete_object(Bucket=self.bucket, Key=entry[0])
        with self._lock:
            self._access.pop(entry[0], None)
        return True

    def _gc_finish(self, dry_run: bool):
        def finish(r: GcResult) -> GcResult:
            if not dry_run:
                with self._lock:
                    self._used_estimate = r.bytes_after
                    self._objects_estimate = r.objects - r.deleted
                self.metrics.used(r.bytes_after)
            return r

        return finish

    def _take_lease(self) -> s3lease.Lease | None:
        """The collector lease, ``_NO_LEASE`` where the server cannot give one
        (collect anyway, see s3lease), None while another collector holds it.
        Raises botocore's errors for backend trouble."""
        if self._no_lease:
            return _NO_LEASE
        try:
            return s3lease.take(self._client(), self.bucket, f"{self.base}/{s3lease.LEASE_NAME}", self.config.gc_lease_s)
        except s3lease.Unsupported as exc:
            log.warning("tier %s: the server refuses conditional requests (%s): collecting without a lease", self.name, exc)
            self._no_lease = True
            return _NO_LEASE

    def _release_lease(self, lease) -> None:
        try:
            s3lease.release(self._client(), self.bucket, lease)
        except (self._errors.BotoCoreError, self._errors.ClientError) as exc:
            # It expires by itself after gc_lease_s.
            log.warning("tier %s: could not release the collector lease: %s", self.name, _brief(exc))

    def _list(self) -> list[tuple[str, int, float]]:
        """(name, size, LastModified) of every kvtier object under the prefix."""
        out = []
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.base + "/")
        for page in pages:
            for o in page.get("Contents", ()):
                if _NAME.match(o["Key"]) and o["Key"].startswith(self.base + "/"):
                    out.append((o["Key"], int(o["Size"]), o["LastModified"].timestamp()))
        return out

    # ------------------------------------------------------------ admin
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, self._objects_estimate, self._used_estimate, self.capacity)

    def close(self) -> None:
        self.executor.close()
        if self._http is not None:
            self._http.close()


class _Leases:
    """The S3 collector lease as ``collector.Leases`` (``s3lease``)."""

    def __init__(self, tier: S3Tier):
        self._tier = tier

    def take(self) -> s3lease.Lease | None:
        return self._tier._take_lease()

    def release(self, lease: s3lease.Lease) -> None:
        if lease is not _NO_LEASE:
            self._tier._release_lease(lease)


def _entry_size(entry: tuple[str, int, float]) -> int:
    return entry[1]


def _brief(exc: BaseException) -> str:
    """An error for logs: botocore's messages name the operation and the
    endpoint, never credentials."""
    return f"{type(exc).__name__}: {exc}"


def _log_failure(name: str, what: str):
    def cb(fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("tier %s: background %s failed: %s", name, what, _brief(fut.exception()))

    return cb
