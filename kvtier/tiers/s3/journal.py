"""The S3 tier's removal journal: which objects collection passes deleted,
for the engines that told routers those objects were there (the shared
directory tier keeps the same journal: ``dir.journal``).

Any node's collection pass deletes objects other engines wrote and
published (KV events, locality ``REMOTE``); their own tiers never see the
deletion. So each pass that deleted anything writes one journal object,
the digests it deleted (``removals``: 32 bytes each), and every engine with
KV events on lists the journal every few seconds and reads each object it
has not read yet.

Layout: ``PREFIX/kvtier-v1/removed/<unix ns>.<host>.<pid>.<random>.rm``,
beside the chunk objects and the collector's lease (a PUT is atomic:
readers see no object or a whole one). Objects older than ``keep_s`` (by
the time in their names) are deleted by the next pass that writes one.

Cost, for a reader: one LIST of ``removed/`` per interval (paginated, 1000
names a page), and one GET per new object. For a writer: one PUT and one
LIST per pass, plus a DELETE per object swept.

Untrusted input: anyone who can write the prefix can write a journal
object. The worst a forged one does is make routers believe some blocks
are gone (a routing miss, never wrong KV): a reader takes only whole
32-byte records, from objects listed at no more than ``MAX_ENTRY`` bytes,
and reads no more than that of any body.

Failure: the journal is a hint. Every backend error is logged and is
"nothing new this time" (an object not read is tried again by the next
read); nothing raises to the caller.

Threads: ``append`` on the collector's thread; ``read_new`` on one
caller's thread at a time (it keeps the names it has read). The client
comes from the tier (``S3Tier._client``: thread-safe, made anew in a
forked child).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from kvtier.tiers.dir.layout import HOST
from kvtier.tiers.removals import FOLDER, KEEP_S, MAX_ENTRY, body, expired, new_name, records, time_of
from kvtier.tiers.s3.client import brief
from kvtier.tiers.s3.lease import http_status

log = logging.getLogger(__name__)


class S3RemovalJournal:
    def __init__(self, client: Callable[[], Any], bucket: str, base: str, keep_s: float = KEEP_S,
                 max_entry: int = MAX_ENTRY):
        """``client``: gives the tier's boto3 client; ``base``: the tier's
        ``PREFIX/kvtier-v1`` (no slash at the end); objects larger than
        ``max_entry`` bytes are not read."""
        import botocore.exceptions  # boto3 is the `s3` extra, imported by the tier already

        self._client = client
        self.bucket = bucket
        self.prefix = f"{base}/{FOLDER}/"  # every journal object's name starts with it
        self.keep_s = keep_s
        self.max_entry = max_entry
        self._trouble = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        self._read: set[str] = set()  # names read already (those still listed)

    def append(self, digests: Iterable[bytes]) -> int:
        """Record one pass's deletions; returns the bytes written (0: none,
        or the journal could not be written: logged, never raised)."""
        data = body(digests)
        if not data:
            return 0
        name = self.prefix + new_name(HOST)
        try:
            self._client().put_object(Bucket=self.bucket, Key=name, Body=data,
                                      ContentType="application/octet-stream")
        except self._trouble as exc:
            log.warning("removal journal s3://%s/%s: not written (%s): routers learn of these deletions late",
                        self.bucket, self.prefix, brief(exc))
            return 0
        self._sweep()
        return len(data)

    def _sweep(self) -> None:
        """Delete the journal objects older than ``keep_s`` (what fails is
        left for the next pass)."""
        try:
            client = self._client()
            for name, _ in self._list():
                if expired(name[len(self.prefix):], self.keep_s):
                    client.delete_object(Bucket=self.bucket, Key=name)
        except self._trouble as exc:
            log.warning("removal journal s3://%s/%s: old entries not swept (%s)", self.bucket, self.prefix, brief(exc))

    def read_new(self) -> list[bytes]:
        """The digests in journal objects not read before by this object
        ([] while the store cannot be listed)."""
        try:
            listed = dict(self._list())
        except self._trouble as exc:
            log.warning("removal journal s3://%s/%s: not read (%s)", self.bucket, self.prefix, brief(exc))
            return []
        out: list[bytes] = []
        read = self._read & listed.keys()  # forget what was swept
        for name in sorted(listed.keys() - read):
            if listed[name] <= self.max_entry:
                try:
                    data = self._get(name)
                except self._trouble as exc:
                    log.warning("removal journal s3://%s/%s: not read (%s)", self.bucket, name, brief(exc))
                    break  # the rest next time
                out += records(data)
            read.add(name)
        self._read = read
        return out

    def _list(self) -> list[tuple[str, int]]:
        """(name, size) of every journal object. Raises botocore's errors."""
        out = []
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for o in page.get("Contents", ()):
                key = o["Key"]
                if key.startswith(self.prefix) and time_of(key[len(self.prefix):]) is not None:
                    out.append((key, int(o["Size"])))
        return out

    def _get(self, name: str) -> bytes:
        """An object's bytes, b"" if it is gone or larger than ``max_entry``
        (its listing may be older than its body). Raises botocore's errors."""
        try:
            stream = self._client().get_object(Bucket=self.bucket, Key=name)["Body"]
        except self._trouble[1] as exc:
            if http_status(exc) == 404:
                return b""  # swept meanwhile
            raise
        try:
            data = stream.read(self.max_entry + 1)
        finally:
            stream.close()
        return data if len(data) <= self.max_entry else b""
