"""The S3 tier's collection pass: the prefix listed, the least recently
used objects deleted down to the low watermark (``Collector``), one pass at
a time per prefix under a lease object (``lease``); what a pass deleted
goes to the removal journal (``journal``). A part of ``S3Tier`` (``tier``),
which owns the state."""

from __future__ import annotations

import logging
import re

from kvtier.tiers.collector import GcResult
from kvtier.tiers.dir.layout import LAYOUT_DIR
from kvtier.tiers.s3 import lease as s3lease
from kvtier.tiers.s3.client import brief

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:.*/)?" + LAYOUT_DIR + r"/([0-9a-f]{16})/([0-9a-f]{64})$")
_NO_LEASE = s3lease.Lease("", "", float("inf"))  # collect without exclusion (server without conditional requests)


class S3Collection:
    """The collection pass of ``S3Tier``."""

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

        delete, finish = self._gc_pass(dry_run)
        return self._collector.collect(listing, _entry_size, lambda e: max(e[2], access.get(e[0], 0.0)),
                                       delete, dry_run, finish)

    def _collect(self, entries: list[tuple[str, int, float]], dry_run: bool, lease: s3lease.Lease | None, t0: float) -> GcResult:
        """The pass over listed ``entries`` under ``lease`` (taken by the caller)."""
        with self._lock:
            access = dict(self._access)
        delete, finish = self._gc_pass(dry_run)
        return self._collector.sweep(entries, _entry_size, lambda e: max(e[2], access.get(e[0], 0.0)),
                                     delete, lease, dry_run, finish, t0)

    def _gc_pass(self, dry_run: bool):
        """One pass's ``delete`` and ``finish`` for ``Collector``: what the
        pass deleted goes to the removal journal as it ends (inside the lease)."""
        deleted: list[bytes] = []

        def delete(entry: tuple[str, int, float]) -> bool:
            self._client().delete_object(Bucket=self.bucket, Key=entry[0])
            with self._lock:
                self._access.pop(entry[0], None)
            self._removed_names([entry[0]])
            deleted.append(bytes.fromhex(entry[0][-64:]))  # listed names end in the digest (_NAME)
            return True

        def finish(r: GcResult) -> GcResult:
            if not dry_run:
                self.journal.append(deleted)
                with self._lock:
                    self._used_estimate = r.bytes_after
                    self._objects_estimate = r.objects - r.deleted
                self.metrics.used(r.bytes_after)
            return r

        return delete, finish

    def _take_lease(self) -> s3lease.Lease | None:
        """The collector lease, ``_NO_LEASE`` where the server cannot give one
        (collect anyway, see ``lease``), None while another collector holds it.
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
            log.warning("tier %s: could not release the collector lease: %s", self.name, brief(exc))

    def _list(self) -> list[tuple[str, int, float]]:
        """(name, size, LastModified) of every kvtier object under the prefix."""
        out = []
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.base + "/")
        for page in pages:
            for o in page.get("Contents", ()):
                if _NAME.match(o["Key"]) and o["Key"].startswith(self.base + "/"):
                    out.append((o["Key"], int(o["Size"]), o["LastModified"].timestamp()))
        return out


class _Leases:
    """The S3 collector lease as ``collector.Leases`` (``lease``)."""

    def __init__(self, tier: S3Collection):
        self._tier = tier

    def take(self) -> s3lease.Lease | None:
        return self._tier._take_lease()

    def release(self, lease: s3lease.Lease) -> None:
        if lease is not _NO_LEASE:
            self._tier._release_lease(lease)


def _entry_size(entry: tuple[str, int, float]) -> int:
    return entry[1]
