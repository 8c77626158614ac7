"""Eviction policies by name, as a tier's config names them (``eviction``).

A name is one of the built-in policies (``BUILTIN``), or the import path
``package.module:Class`` of a policy class kvtier does not ship (a subclass
of ``EvictionPolicy`` on ``sys.path``: one file, see docs/architecture.md,
"Adding an eviction policy"). The capacity planner resolves the same names,
so it simulates the policy the tiers run.
"""

from __future__ import annotations

import importlib

from kvtier.errors import ConfigError
from kvtier.tiers.eviction.base import EvictionPolicy
from kvtier.tiers.eviction.lfu import LFUPolicy
from kvtier.tiers.eviction.lru import LRUPolicy
from kvtier.tiers.eviction.watermark import WatermarkPolicy

BUILTIN: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRUPolicy, WatermarkPolicy, LFUPolicy)}


def policy_class(name: str, key: str = "eviction") -> type[EvictionPolicy]:
    """The class ``name`` names; ConfigError naming ``key`` if none."""
    cls = BUILTIN.get(name)
    if cls is not None:
        return cls
    if ":" not in name:
        raise ConfigError(key, f"unknown eviction policy {name!r}",
                          f"use one of: {', '.join(BUILTIN)}; or give a policy class as package.module:Class")
    module, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(key, f"cannot load eviction policy {name!r} ({exc})",
                          "put its module on the Python path and write it as package.module:Class") from None
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ConfigError(key, f"{name!r} is {obj!r}, not an eviction policy class",
                          "point it at a subclass of kvtier.tiers.eviction.EvictionPolicy")
    return obj


def misfit(cls: type[EvictionPolicy], config) -> str:
    """Why a tier under ``config`` (an instance or a config class) cannot run
    ``cls``; '' if it can."""
    if getattr(config, "stamped_recency", False) and not cls.ranks_by_recency:
        return ("orders by more than recency, and this tier knows only each object's recency stamp "
                "(the processes that share it see one another's reads no other way)")
    missing = [s for s in cls.settings if not hasattr(config, s)]
    if missing:
        return f"needs {', '.join(missing)}, which this tier's config has not"
    return ""


def fitting(config) -> list[str]:
    """The built-in names a tier under ``config`` can run."""
    return [n for n, cls in BUILTIN.items() if not misfit(cls, config)]


def check(name: str, config, key: str = "eviction") -> None:
    """Raise ConfigError naming ``key`` unless a tier under ``config`` can
    run the policy ``name``."""
    problem = misfit(policy_class(name, key), config)
    if problem:
        raise ConfigError(key, f"eviction policy {name!r} {problem}", f"use one of: {', '.join(fitting(config))}")


def make(name: str, config, key: str = "eviction") -> EvictionPolicy:
    """A new, empty policy ``name`` under ``config`` (its capacity and settings)."""
    return policy_class(name, key).of(config)
