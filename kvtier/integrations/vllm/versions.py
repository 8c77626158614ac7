"""Which vLLM releases the connector runs on.

kvtier is written against vLLM's connector API of the releases from
``OLDEST_VLLM`` to ``NEWEST_VLLM`` (docs/vllm.md says how each was
checked). Older ones are refused; newer ones start with a warning. The
version is part of every namespace either way (``namespace.layout_name``).
"""

from __future__ import annotations

import logging

from kvtier.errors import ConfigError

OLDEST_VLLM = (0, 30)
NEWEST_VLLM = (0, 33)
log = logging.getLogger(__name__)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0+cpu", "0.33.1.dev4+g1a2b")."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM older than the oldest supported release (its connector
    API differs), warn on one newer than the newest checked."""
    oldest, newest = ".".join(map(str, OLDEST_VLLM)), ".".join(map(str, NEWEST_VLLM))
    rel = release(version)
    if rel is None or rel < OLDEST_VLLM:
        raise ConfigError("vllm", f"vLLM {version} is older than kvtier supports",
                          f"use vLLM {oldest} to {newest}.x")
    if rel > NEWEST_VLLM:
        log.warning("kvtier: vLLM %s is newer than the newest release kvtier was checked with (%s.x); "
                    "it starts, but report any failure with the vLLM version", version, newest)
