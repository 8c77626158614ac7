"""The removal journal's format, the same for every tier that keeps one
(``dir.journal`` for the shared directory tier, ``s3.journal`` for the S3
tier): where its entries live, how they are named, what they hold.

An entry is one collection pass's deletions: the 32-byte digests of the
objects it deleted, back to back, in ``kvtier-v1/removed/`` of the tier,
named ``<unix ns>.<host>.<pid>.<random>.rm`` (the write time first, so the
names sort by it and a writer can sweep the old ones without reading them).
Anyone who can write the store can write an entry: a reader takes only
whole records, from entries of at most ``MAX_ENTRY`` bytes.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Iterable

FOLDER = "removed"
SUFFIX = ".rm"
RECORD = 32
MAX_ENTRY = 64 << 20  # two million digests: larger entries are not read
KEEP_S = 24 * 3600.0  # entries older than this are swept by the next pass that writes one


def body(digests: Iterable[bytes]) -> bytes:
    """An entry's bytes: the whole digests among ``digests``."""
    return b"".join(d for d in digests if len(d) == RECORD)


def new_name(host: str) -> str:
    """A fresh entry's name, written now by this process on ``host``."""
    return f"{time.time_ns()}.{host}.{os.getpid()}.{secrets.token_hex(6)}{SUFFIX}"


def time_of(name: str) -> int | None:
    """The write time (unix ns) in an entry's name, or None for any other name."""
    if not name.endswith(SUFFIX) or name.startswith(".") or "/" in name:
        return None
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def expired(name: str, keep_s: float) -> bool:
    """Whether ``name`` is an entry written more than ``keep_s`` ago."""
    t = time_of(name)
    return t is not None and t < time.time_ns() - int(keep_s * 1e9)


def records(data: bytes) -> list[bytes]:
    """The whole records of an entry's bytes (a torn tail is left out)."""
    return [data[i : i + RECORD] for i in range(0, len(data) - RECORD + 1, RECORD)]
