"""``kvtier store verify --tier redis://HOST:PORT``: every object of a Redis
tier checked from outside the engines, as ``admin/dirstore.py`` checks a
directory tier's.

The tier is opened as an engine opens it (``RedisTier``: the same client,
TLS for ``rediss://``, a cluster's slot map, credentials from the same
``KVTIER_REDIS_*`` variables, never from the URL). Its index sorted set
``{<key_prefix>idx}:lru`` names every object; it is walked with ``ZSCAN``
(a bounded batch of names at a time, so memory does not grow with the
store), each batch's values are fetched with pipelined ``STRLEN`` and
``GET`` (a bounded number of bytes at a time), and each value is checked
for what it promises itself, the way a read checks it: its header parses,
its key and namespace are those of its name, ``codec.decode`` accepts it for
the key its header names (length, padding, checksum), and, with a keyring,
its seal checks out (``codec.seal_problem``), as an engine holding those
keys demands before it serves it.

Verification reads without touching: a plain ``GET`` neither refreshes an
object's TTL nor moves it in the access order. A name whose value is gone
was evicted or expired meanwhile and is skipped. Redis has no quarantine
folder: with ``delete`` a bad object is deleted through the tier's own
delete (``RedisTier.delete_names``: unindexed, then deleted, so the index
and the byte budget stay right), as a read that finds it bad deletes it.
``ZSCAN`` may return a name twice while the index grows meanwhile; such an
object is then counted twice.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from kvtier.auth import SEAL_PROBLEMS, Keyring
from kvtier.codec import HEADER_BLOCK, HEADER_STRUCT_SIZE, MAX_PAYLOAD, decode, parse_header, seal_problem
from kvtier.config import ConfigError, TierSpec, parse_tier, parse_tier_url, with_env_secrets
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.progress import Progress, silent

SCAN_COUNT = 256  # names asked of each ZSCAN step (a hint to Redis)
GET_BATCH_BYTES = 64 << 20  # values fetched by one pipeline, at most (a larger one goes alone)
_MAX_VALUE = HEADER_BLOCK + MAX_PAYLOAD  # longer is not a chunk object: never fetched


@dataclass
class RedisReport:
    ok: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (object name, why)
    deleted: int = 0


def tier_spec(url: str, environ: Mapping[str, str]) -> TierSpec:
    """The Redis tier of ``url`` (``redis://``, ``rediss://``; a cluster by
    ``cluster=true``), its secrets from ``environ`` as the engine's config
    takes them. Raises ConfigError naming ``--tier``."""
    values: dict[str, Any] = parse_tier_url(url, "--tier")
    if values["kind"] != "redis":
        raise ConfigError("--tier", f"{values['kind']}:// is not a tier `kvtier store verify --tier` walks",
                          "write redis://HOST:PORT[?options] (rediss:// for TLS), s3://BUCKET/PREFIX?endpoint=URL for an S3 "
                          "tier, or --dir DIR for a directory tier")
    # Verification admits nothing, so the budget is never used; the URL may leave it out.
    values.setdefault("capacity", "1PiB")
    return with_env_secrets(parse_tier(values, "--tier"), environ)


def verify_redis(url: str, delete: bool = False, progress: Progress = silent, keyring: Keyring | None = None,
                 environ: Mapping[str, str] | None = None) -> RedisReport:
    """Check every object of the Redis tier at ``url`` (see the module's
    docstring); with ``delete``, delete the bad ones. Raises ConfigError
    (exit status 2) for a bad URL, or a server that cannot be reached or is
    lost on the way."""
    from kvtier.tiers.redis.tier import _TROUBLE, RedisTier

    spec = tier_spec(url, os.environ if environ is None else environ)
    cfg = spec.config
    tier = RedisTier(cfg)
    report = RedisReport()
    try:
        try:
            client, index = tier.index()
            total = int(client.zcard(index))
        except _TROUBLE as exc:
            raise ConfigError("--tier", f"cannot reach the Redis server at {cfg.address} ({_brief(exc)})",
                              "check the address and that the server runs; a password comes from "
                              "KVTIER_REDIS_PASSWORD (or KVTIER_REDIS_PASSWORD_<TIER NAME>), TLS from rediss:// "
                              "with tls_ca_file=..., a cluster from cluster=true") from None
        tick = progress("verify", total)
        name_re = re.compile(re.escape(cfg.key_prefix.encode()) + rb"([0-9a-f]{16}):([0-9a-f]{64})")
        try:
            for names in _batches(client.zscan_iter(index, count=SCAN_COUNT), SCAN_COUNT):
                bad: list[bytes] = []
                for name, value in _values(client, names):
                    if value is not None:
                        why = (f"value size {value} out of range" if isinstance(value, int)
                               else _problem(name, value, name_re, keyring))
                        if why is None:
                            report.ok += 1
                        else:
                            report.bad.append((name.decode(errors="replace"), why))
                            bad.append(name)
                    tick(1)
                if delete and bad:
                    report.deleted += tier.delete_names(bad)
        except _TROUBLE as exc:
            raise ConfigError("--tier", f"lost the Redis server at {cfg.address} after {report.ok + len(report.bad)} "
                              f"objects ({_brief(exc)})", "check the server, then run verify again (it starts "
                              "over; what was deleted stays deleted)") from None
    finally:
        tier.close()
    return report


def _problem(name: bytes, value: bytes, name_re: re.Pattern, keyring: Keyring | None) -> str | None:
    """Why an engine would not serve ``value`` under ``name``, or None."""
    m = name_re.fullmatch(name)
    if m is None:
        return "not an object name of this key prefix"
    try:
        check_value(value, m.group(1).decode(), m.group(2).decode(), keyring)
    except CorruptObject as exc:
        return str(exc)
    return None


def check_value(value: bytes, ns_hex: str, key_hex: str, keyring: Keyring | None) -> None:
    """Raise CorruptObject unless ``value`` is a whole object for the key
    and namespace its name gives (16 and 64 hex digits) that a read accepts,
    and, with ``keyring``, whose seal checks out under one of its keys."""
    if not HEADER_BLOCK <= len(value) <= _MAX_VALUE:
        raise CorruptObject(f"value size {len(value)} out of range")
    h = parse_header(value[:HEADER_STRUCT_SIZE])
    if h.key.hex() != key_hex or h.ns[:8].hex() != ns_hex:
        raise CorruptObject("header key or namespace does not match the object's name")
    obj = decode(memoryview(value), ChunkKey(h.key, h.check, h.ns, h.num_tokens), len(value))
    if h.object_len != len(value):
        raise CorruptObject(f"value is {len(value)} B, the object {h.object_len} B")
    problem = None if keyring is None else seal_problem(obj, keyring)
    if problem is not None:
        raise CorruptObject(f"not served: {problem} ({SEAL_PROBLEMS[problem]})")


def _batches(members: Iterator[tuple[bytes, float]], n: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for name, _score in members:
        batch.append(name)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def _values(client: Any, names: list[bytes]) -> Iterator[tuple[bytes, bytes | int | None]]:
    """(name, value) for ``names``: None for a value that is gone, and for a
    value too long to be an object its length alone (it is never fetched)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    sizes = [int(s) for s in pipe.execute()]
    group: list[bytes] = []
    held = 0
    for name, size in zip(names, sizes):
        if size > _MAX_VALUE:
            yield name, size
            continue
        if group and held + size > GET_BATCH_BYTES:
            yield from _get(client, group)
            group, held = [], 0
        group.append(name)
        held += size
    yield from _get(client, group)


def _get(client: Any, names: list[bytes]) -> Iterator[tuple[bytes, bytes | None]]:
    if not names:
        return
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(name)
    yield from zip(names, pipe.execute())


def _brief(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
