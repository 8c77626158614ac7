"""``kvtier store verify --tier s3://BUCKET/PREFIX?endpoint=...``: every
object of an S3 tier checked from outside the engines, as ``redis_verify``
checks a Redis tier's.

The tier is opened as an engine opens it (``S3Tier``: the same boto3 client,
endpoint, TLS settings and timeouts; credentials from the same
``KVTIER_S3_*`` variables or boto3's chain, never from the URL). Its prefix
``PREFIX/kvtier-v1/`` is listed with ``ListObjectsV2`` one page at a time
(at most 1000 names, so memory does not grow with the store). Names that are
not chunk objects (``<ns 16 hex>/<key 64 hex>``), such as the collector's
lease, are skipped. Each object is fetched with a plain ``GET`` (at most one
object's bytes at a time; a listed size no object can have is reported
without fetching) and checked the way a read checks it
(``redis_verify.check_value``): header, key and namespace of its name,
length, padding, checksum and, with a keyring, its seal.

A plain ``GET`` leaves ``LastModified`` as it is, so verification does not
change the collector's order. An object listed but gone by its ``GET`` was
collected meanwhile and is skipped. S3 has no quarantine folder: with
``delete`` a page's bad objects are deleted through the tier's own delete
(``S3Tier.delete_names``), as a read that finds one bad deletes it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterator, Mapping

from kvtier.auth import Keyring
from kvtier.codec import HEADER_BLOCK, MAX_PAYLOAD
from kvtier.config import ConfigError, TierSpec, parse_tier, parse_tier_url, with_env_secrets
from kvtier.errors import CorruptObject
from kvtier.progress import Progress, silent
from kvtier.admin.redis_verify import RedisReport, check_value

_MAX_VALUE = HEADER_BLOCK + MAX_PAYLOAD  # longer is not a chunk object: never fetched
_FIX = ("check the endpoint (endpoint=http://HOST:PORT in the URL), that the server runs and the bucket exists; "
        "credentials come from KVTIER_S3_ACCESS_KEY_ID and KVTIER_S3_SECRET_ACCESS_KEY (or boto3's AWS_* "
        "variables, profile, role)")

_SKIP = "skip"  # _check's answer for a name that is no chunk object, or one gone


def tier_spec(url: str, environ: Mapping[str, str]) -> TierSpec:
    """The S3 tier of ``url`` (``s3://BUCKET/PREFIX?endpoint=...``), its
    keys from ``environ`` as the engine's config takes them. Raises
    ConfigError naming ``--tier``."""
    values: dict[str, Any] = parse_tier_url(url, "--tier")
    if values["kind"] != "s3":
        raise ConfigError("--tier", f"{values['kind']}:// is not an S3 tier", "write s3://BUCKET/PREFIX?endpoint=...")
    values.setdefault("capacity", "1PiB")  # verification admits nothing: the budget is never used
    spec = with_env_secrets(parse_tier(values, "--tier"), environ)
    # Verification creates nothing and never collects.
    return TierSpec(spec.kind, dataclasses.replace(spec.config, create_bucket=False, gc_interval_s=0.0))


def verify_s3(url: str, delete: bool = False, progress: Progress = silent, keyring: Keyring | None = None,
              environ: Mapping[str, str] | None = None) -> RedisReport:
    """Check every object of the S3 tier at ``url`` (see the module's
    docstring); with ``delete``, delete the bad ones. Raises ConfigError
    (exit status 2) for a bad URL, an endpoint that cannot be reached, a
    missing bucket or refused credentials, also when lost on the way."""
    import botocore.exceptions

    from kvtier.tiers.s3.tier import S3Tier

    trouble = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
    spec = tier_spec(url, os.environ if environ is None else environ)
    cfg = spec.config
    tier = S3Tier(cfg)
    where = f"s3://{cfg.bucket}/{tier.base}/ at {cfg.endpoint or 'AWS S3'}"
    report = RedisReport()
    name_re = re.compile(re.escape(tier.base) + r"/([0-9a-f]{16})/([0-9a-f]{64})")
    started = False
    try:
        client = tier.client()
        for page in _pages(client, tier.bucket, tier.base + "/"):
            started = True
            bad: list[str] = []
            # The total is unknown until the listing ends: a bar per page.
            tick = progress("verify", len(page))
            for o in page:
                why = _check(client, tier.bucket, o["Key"], int(o["Size"]), name_re, keyring)
                tick(1)
                if why is _SKIP:
                    continue
                if why is None:
                    report.ok += 1
                else:
                    report.bad.append((o["Key"], why))
                    bad.append(o["Key"])
            if delete and bad:
                report.deleted += tier.delete_names(bad)
    except trouble as exc:
        if not started:
            raise ConfigError("--tier", f"cannot list {where} ({_brief(exc)})", _FIX) from None
        raise ConfigError("--tier", f"lost {where} after {report.ok + len(report.bad)} objects ({_brief(exc)})",
                          "check the server, then run verify again (it starts over; what was deleted stays "
                          "deleted)") from None
    finally:
        tier.close()
    return report


def _pages(client: Any, bucket: str, prefix: str) -> Iterator[list[dict]]:
    """The listing of ``prefix``, a page at a time (the first request is
    made before the first page is yielded, so trouble shows there)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        yield page.get("Contents", [])


def _check(client: Any, bucket: str, name: str, size: int, name_re: re.Pattern, keyring: Keyring | None) -> str | None:
    """Why an engine would not serve the object ``name``; None if it would;
    ``_SKIP`` if it is no chunk object (the collector's lease) or gone
    (collected meanwhile)."""
    m = name_re.fullmatch(name)
    if m is None:
        return _SKIP
    if size > _MAX_VALUE:
        return f"object size {size} out of range"
    value = _get(client, bucket, name)
    if value is None:
        return _SKIP
    try:
        check_value(value, m.group(1), m.group(2), keyring)
    except CorruptObject as exc:
        return str(exc)
    return None


def _get(client: Any, bucket: str, name: str) -> bytes | None:
    """The object's bytes, at most one more than an object may have; None
    if it is gone."""
    try:
        body = client.get_object(Bucket=bucket, Key=name)["Body"]
    except client.exceptions.NoSuchKey:
        return None
    try:
        return body.read(_MAX_VALUE + 1)
    finally:
        body.close()


def _brief(exc: BaseException) -> str:
    """botocore's messages name the operation and the endpoint, never
    credentials."""
    return f"{type(exc).__name__}: {exc}"
