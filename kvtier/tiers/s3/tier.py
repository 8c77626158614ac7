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
  plain HTTP requests to URLs this tier's boto3 client presigns (``presigned``:
  half the client CPU of boto3's own calls); any answer but 200 or 404 is
  repeated through boto3. A bad object is a miss, is counted as an integrity
  failure, and is deleted.
- Failure: every call has connect and read timeouts and at most
  ``max_attempts`` tries (botocore's standard retry mode: exponential backoff
  with jitter). Callers wait no longer than their own deadline; the circuit
  breaker skips the tier after repeated failures. Nothing raises to the caller.
- Capacity (S3 has no atime and no cheap usage figure): a collector (``gc``)
  lists the prefix, takes usage from the listing and deletes what the
  ``eviction`` policy picks, by default (``watermark``) the least recently
  used objects once usage passes ``high_watermark``, down to
  ``low_watermark``. Recency is the later of the object's ``LastModified`` and
  this process's own last access to it (an in-process index of the most recent
  ``access_index_entries`` keys). So that other instances see hits too, a hit
  on an object whose ``LastModified`` is older than ``touch_interval_s``
  refreshes it by a server-side self-copy (in the background, at most once per
  interval per object). Any instance may collect; a lease object
  (``lease``: conditional PUTs) lets one pass run at a time per prefix, so
  two collectors never both delete. Still, let one or a few instances collect
  (``gc_interval_s: 0`` elsewhere): every pass lists the whole prefix.
  Each pass that deleted anything writes the digests it deleted to the
  removal journal (``journal``), which every engine with KV events on reads.

Threads: every backend call runs on this tier's ``PriorityExecutor`` (loads
before deletes before stores before maintenance). The boto3 client is made in
the constructor (no network I/O) and is thread-safe; it is re-created in a
forked child, which must not share the parent's connections.

Parts, one module each: ``config`` (``S3Config``), ``client`` (the boto3
client, the bucket), ``reads`` (HEADs and GETs, verification, recency
refreshes), ``writes`` (conditional PUTs, deletes), ``collect`` (the
collection pass under its lease), ``presigned`` (the plain HTTP requests),
``lease`` (the lease object), ``journal`` (the removal journal). ``S3Tier``
here owns the state they share: the client, the recency index, the usage
estimate, the fallbacks.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from kvtier.concurrency.executor import PriorityExecutor
from kvtier.keys import ChunkKey
from kvtier.tiers.base import TierStats
from kvtier.tiers.collector import Collector, Trigger
from kvtier.tiers.eviction import make
from kvtier.tiers.dir.layout import LAYOUT_DIR
from kvtier.tiers.pooled import PooledTier
from kvtier.tiers.s3 import presigned
from kvtier.tiers.s3.client import S3Client
from kvtier.tiers.s3.collect import S3Collection, _Leases
from kvtier.tiers.s3.config import S3Config
from kvtier.tiers.s3.journal import S3RemovalJournal
from kvtier.tiers.s3.reads import S3Reads
from kvtier.tiers.s3.writes import S3Writes


class S3Tier(S3Client, S3Reads, S3Writes, S3Collection, PooledTier):
    kind = "s3"
    shared_medium = True
    Config = S3Config

    def __init__(self, config: S3Config, metrics=None, breaker=None, pool=None):
        import botocore.exceptions  # boto3 is the `s3` extra: fail here, not at import of kvtier

        super().__init__(config, metrics, breaker, pool)
        self._errors = botocore.exceptions
        self._backend_errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, *presigned.HTTP_ERRORS)
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
        # What collection passes deleted, for other engines' KV events (journal.py).
        self.journal = S3RemovalJournal(self._client, self.bucket, self.base)
        self._trigger = Trigger(make(config.eviction, config), config.gc_interval_s)
        self._collector: Collector[tuple[str, int, float]] = Collector(
            self.name, lambda: make(config.eviction, config), _Leases(self), self.metrics,
            (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError))
        # GETs and HEADs as presigned plain HTTP requests (``presigned``), unless a
        # proxy stands between us and the endpoint.
        self._http = (presigned.PresignedHTTP(config, self._client, max_idle=config.io_threads + 8)
                      if presigned.enabled(config.endpoint) else None)
        # Made now rather than by the first lookup: boto3's set-up (imports,
        # service model) costs 0.1-1 s of CPU, which a fresh engine's first
        # lookup would otherwise spend inside its deadline (and miss). It
        # does no network I/O, so a server down at start still only shows
        # as failing calls later.
        self._client()
        if config.create_bucket:
            self._create_bucket()

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

    # ------------------------------------------------------------ admin
    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.name, self.kind, self._objects_estimate, self._used_estimate, self.capacity)

    def close(self) -> None:
        self.executor.close()
        if self._http is not None:
            self._http.close()
