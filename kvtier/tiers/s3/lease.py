"""The S3 collector's lease: at most one collection pass per prefix at a time.

One small object, ``<base>/gc.lease``, is published by a conditional PUT
(``If-None-Match: *``): of collectors that start together exactly one gets
it. A lease expires ``lease_s`` after its ``LastModified``, judged against the
server's own clock (the ``Date`` of the same HEAD response), so clock skew
between instances never matters. A stale lease (its holder died) is taken
over by a PUT with ``If-Match: <its ETag>``: of collectors taking over at once
only one wins. The holder stops deleting when its time is up (counted from
before its PUT, less a second for the one-second resolution of
``LastModified``), so it is done before anyone may take over; it releases the
lease by a DELETE with ``If-Match``, which cannot remove a successor's lease.

All of this needs conditional requests (AWS S3 since 2024, SeaweedFS 4.x,
recent MinIO). A server that refuses them gets no exclusion: the caller then
collects without a lease (deleting a content-addressed object is always safe;
only work is duplicated). A server that silently ignores the headers cannot
be told apart from here; it, too, only duplicates work.

Callers pass a boto3 S3 client; every function raises botocore's errors for
backend trouble and never waits longer than the client's own timeouts.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

LEASE_NAME = "gc.lease"
# LastModified and Date have one-second resolution: a holder gives up its
# lease this much before anyone else could judge it stale.
_RESOLUTION_S = 1.0


class Unsupported(Exception):
    """The server refuses conditional requests: no lease is possible."""


@dataclass(frozen=True)
class Lease:
    name: str
    etag: str
    deadline: float  # time.monotonic() after which the holder must stop

    def valid(self) -> bool:
        return time.monotonic() < self.deadline


def take(client: Any, bucket: str, name: str, lease_s: float) -> Lease | None:
    """Take the lease; None while another collector holds a live one.
    Raises ``Unsupported`` if the server refuses conditional PUTs."""
    # A random token makes every lease's bytes, hence its ETag, unique: the
    # If-Match conditions below tell two leases of one process apart too.
    body = json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "token": secrets.token_hex(8), "lease_s": lease_s}
    ).encode()
    t0 = time.monotonic()
    etag = _put(client, bucket, name, body, IfNoneMatch="*")
    if etag is None:  # a lease exists: is it stale?
        try:
            head = client.head_object(Bucket=bucket, Key=name)
        except client.exceptions.ClientError as exc:
            if http_status(exc) == 404:
                return None  # released meanwhile: the next pass takes it
            raise
        if not _stale(head, lease_s):
            return None
        t0 = time.monotonic()
        etag = _put(client, bucket, name, body, IfMatch=head["ETag"])
        if etag is None:
            return None  # another collector took the stale lease over first
    return Lease(name, etag, t0 + lease_s - _RESOLUTION_S)


def release(client: Any, bucket: str, lease: Lease) -> bool:
    """Remove the lease if it is still ours (a successor's stays). True if removed."""
    try:
        client.delete_object(Bucket=bucket, Key=lease.name, IfMatch=lease.etag)
    except client.exceptions.ClientError as exc:
        if http_status(exc) in (404, 409, 412):
            return False
        raise
    return True


def _put(client: Any, bucket: str, name: str, body: bytes, **cond: str) -> str | None:
    """A conditional PUT: the new ETag, or None if the condition failed."""
    try:
        r = client.put_object(Bucket=bucket, Key=name, Body=body, ContentType="application/json", **cond)
    except client.exceptions.ClientError as exc:
        status = http_status(exc)
        if status in (409, 412) or (status == 404 and "IfMatch" in cond):
            return None  # exists / changed / gone since we looked
        if status in (400, 501):
            raise Unsupported(f"{error_code(exc) or status}") from exc
        raise
    return r["ETag"]


def _stale(head: dict, lease_s: float) -> bool:
    # The server's own clock; this host's only if the response has no Date.
    date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = parsedate_to_datetime(date).timestamp() if date else time.time()
    return head["LastModified"].timestamp() + lease_s < now


def http_status(exc: Exception) -> int:
    """The HTTP status of a botocore ClientError (0 if it has none)."""
    try:
        return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])  # type: ignore[attr-defined]
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0


def error_code(exc: Exception) -> str:
    """The S3 error code of a botocore ClientError ("" if it has none)."""
    try:
        return str(exc.response["Error"]["Code"])  # type: ignore[attr-defined]
    except (AttributeError, KeyError, TypeError):
        return ""
