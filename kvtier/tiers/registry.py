"""Tier kinds by name, imported lazily (importing kvtier pulls in no backend).

Each entry names the module and the class; the class carries its config
dataclass as ``Config``. Backends that need extra packages say how to get them.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.errors import ConfigError

# kind -> (module, class, pip extra needed or None)
_KINDS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("kvtier.tiers.memory", "MemoryTier", None),
    "shm": ("kvtier.tiers.shm", "ShmTier", None),
    "disk": ("kvtier.tiers.disk", "DiskTier", None),
    "shared": ("kvtier.tiers.shared", "SharedTier", None),
    "redis": ("kvtier.tiers.redis", "RedisTier", "redis"),
    "s3": ("kvtier.tiers.s3", "S3Tier", "s3"),
}

# URL location field per kind: what ``kind://LOCATION`` fills in.
_LOCATION_FIELD = {"memory": None, "shm": "path", "disk": "path", "shared": "path", "redis": "address", "s3": "location"}
_ALIASES = {"file": "shared", "dir": "shared"}


def kinds() -> list[str]:
    return sorted(_KINDS)


def resolve(kind: str, key: str = "kind") -> Any:
    kind = _ALIASES.get(kind, kind)
    if kind not in _KINDS:
        raise ConfigError(key, f"unknown tier kind {kind!r}", f"use one of: {', '.join(kinds())}")
    module, cls, extra = _KINDS[kind]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = f"pip install 'kvtier[{extra}]'" if extra else "reinstall kvtier"
        raise ConfigError(key, f"tier kind {kind!r} cannot be loaded ({exc})", hint) from None
    return getattr(mod, cls)


def config_class(kind: str, key: str = "kind") -> type:
    return resolve(kind, key).Config


def normalise_url_values(values: dict[str, Any], key: str) -> dict[str, Any]:
    kind = _ALIASES.get(values["kind"], values["kind"])
    if kind not in _KINDS:  # say so, rather than that the location is not taken
        resolve(kind, f"{key}.kind")
    values["kind"] = kind
    location = values.pop("location", None)
    if location is not None:
        field = _LOCATION_FIELD.get(kind)
        if field is None:
            raise ConfigError(key, f"tier kind {kind!r} takes no location ({location!r})", f"write {kind}://?capacity=...")
        values[field] = location
    return values
