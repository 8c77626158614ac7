"""Tier kinds by name, imported lazily (importing kvtier pulls in no backend).

A tier's ``kind`` in the configuration is one of:

- a built-in kind (``_KINDS``): the module, the class and the pip extra it
  needs;
- the name of a kind another package provides through the ``kvtier.tiers``
  entry-point group (``sqlite = "kvtier_sqlite:SqliteTier"`` in its
  ``pyproject.toml``): installing the package adds the kind;
- an import path ``package.module:Class``: a tier class on ``sys.path``,
  nothing installed.

Built-in names always win: a package cannot replace a kind kvtier ships.
Whatever the route, the class must be a ``Tier`` subclass carrying its config
dataclass as ``Config``; a class may name the config field a URL's location
fills (``url_location = "path"``: ``KIND:///some/dir?capacity=1GiB``);
``rediss://`` is the ``redis`` kind with ``tls`` on. The
worked example is ``examples/sqlite_tier`` (docs/architecture.md, "Adding a
tier kind"). Nothing here is process-global state: every process that reads
the same configuration resolves the same classes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from kvtier.errors import ConfigError

ENTRY_POINT_GROUP = "kvtier.tiers"

# kind -> (module, class, pip extra needed or None)
_KINDS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("kvtier.tiers.memory", "MemoryTier", None),
    "shm": ("kvtier.tiers.shm", "ShmTier", None),
    "disk": ("kvtier.tiers.disk", "DiskTier", None),
    "shared": ("kvtier.tiers.shared", "SharedTier", None),
    "redis": ("kvtier.tiers.redis.tier", "RedisTier", "redis"),
    "s3": ("kvtier.tiers.s3.tier", "S3Tier", "s3"),
}

# URL location field per built-in kind: what ``kind://LOCATION`` fills in.
_LOCATION_FIELD = {"memory": None, "shm": "path", "disk": "path", "shared": "path", "redis": "address", "s3": "location"}
_ALIASES = {"file": "shared", "dir": "shared"}
# URL schemes that are a built-in kind with one setting forced on:
# rediss:// is redis:// over TLS (the scheme redis-py and redis-cli use).
_TLS_SCHEMES = {"rediss": "redis"}


def kinds() -> list[str]:
    """Built-in kinds and those installed packages provide."""
    return sorted(set(_KINDS) | set(_entry_points()))


def resolve(kind: str, key: str = "kind") -> Any:
    """The tier class of ``kind`` (see the module's docstring); ConfigError
    naming ``key`` if there is none or it cannot be loaded."""
    kind = _ALIASES.get(kind, kind)
    if kind in _KINDS:
        module, cls, extra = _KINDS[kind]
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'kvtier[{extra}]'" if extra else "reinstall kvtier"
            raise ConfigError(key, f"tier kind {kind!r} cannot be loaded ({exc})", hint) from None
        return getattr(mod, cls)
    if ":" in kind:
        return _checked(_load_path(kind, key), kind, key)
    ep = _entry_points().get(kind)
    if ep is None:
        raise ConfigError(key, f"unknown tier kind {kind!r}",
                          f"use one of: {', '.join(kinds())}; or install the package that provides it (entry point "
                          f"group {ENTRY_POINT_GROUP}); or give a tier class as package.module:Class")
    try:
        cls = ep.load()
    except Exception as exc:  # whatever the plugin's import raises: name it and the package
        dist = getattr(ep.dist, "name", "its package")
        raise ConfigError(key, f"tier kind {kind!r} ({ep.value}, from {dist}) cannot be loaded "
                          f"({type(exc).__name__}: {exc})", f"fix or reinstall {dist}") from None
    return _checked(cls, kind, key)


def config_class(kind: str, key: str = "kind") -> type:
    return resolve(kind, key).Config


def url_kind(scheme: str, key: str) -> tuple[str, bool, str | None]:
    """What a tier URL's scheme names: the tier kind, whether the scheme
    asks for TLS (``rediss``), and the config field its location fills
    (None: the kind takes no location). A plugin's scheme is its kind."""
    kind = _ALIASES.get(scheme, scheme)
    tls = kind in _TLS_SCHEMES
    kind = _TLS_SCHEMES.get(kind, kind)
    if kind in _KINDS:
        return kind, tls, _LOCATION_FIELD.get(kind)
    # A plugin: say if it is unknown, rather than that the location is not taken.
    return kind, tls, getattr(resolve(kind, f"{key}.kind"), "url_location", None)


def default_name(kind: str) -> str:
    """A tier's name when its config gives none: its kind, or for an import
    path the class's own ``kind``."""
    return str(getattr(resolve(kind), "kind", kind)) if ":" in kind else kind


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Kinds installed packages provide (read on each call: cheap, and a
    package installed meanwhile counts)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name not in _KINDS}


def _load_path(path: str, key: str) -> Any:
    module, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(key, f"cannot import {module!r} for tier kind {path!r} ({exc})",
                          "put the module on the Python path (PYTHONPATH, or install its package)") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(key, f"{module!r} has no {attr!r} (tier kind {path!r})",
                              "write the tier class as package.module:Class") from None
    return obj


def _checked(cls: Any, kind: str, key: str) -> Any:
    from kvtier.tiers.base import Tier

    if not (isinstance(cls, type) and issubclass(cls, Tier)) or not isinstance(getattr(cls, "Config", None), type):
        raise ConfigError(key, f"tier kind {kind!r} is {cls!r}, not a kvtier Tier class with a Config dataclass",
                          "point it at a subclass of kvtier.tiers.base.Tier that sets Config")
    return cls
