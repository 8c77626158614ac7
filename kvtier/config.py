"""Typed, frozen configuration, parsed once at the edge.

Precedence: a config file (YAML, TOML or JSON) < environment ``KVTIER_*`` <
explicit overrides (CLI flags, vLLM's ``kv_connector_extra_config``). Tiers get
their own config objects and never read the environment themselves.

Every error names the key and the fix (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kvtier.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: Any, key: str) -> int:
    """Bytes from ``1048576``, ``"512MiB"``, ``"8G"`` (binary) or ``"10GB"`` (decimal)."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size, got {value!r}", "write a byte count such as 8GiB or 500MB")
    if isinstance(value, (int, float)):
        n = int(value)
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(key, f"cannot read size {value!r}", "write a byte count such as 8GiB, 512MiB or 10GB")
        number, unit, suffix = float(m.group(1)), m.group(2).lower(), m.group(3).lower()
        base = 1000 if suffix == "b" and unit else 1024
        n = int(number * base ** _UNITS[unit])
    if n < 0:
        raise ConfigError(key, f"size {value!r} is negative", "use a positive size")
    return n


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(key, f"expected true or false, got {value!r}", "write true or false")


def size_field(default: int, doc: str) -> Any:
    return field(default=default, metadata={"size": True, "doc": doc})


def opt(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def check_watermarks(prefix: str, low: float, high: float) -> None:
    """A collector's watermarks (shared directory, S3): 0 < low < high <= 1."""
    if not 0 < low < high <= 1:
        raise ConfigError(
            f"{prefix}low_watermark",
            f"need 0 < low_watermark ({low}) < high_watermark ({high}) <= 1",
            "use e.g. low_watermark: 0.85, high_watermark: 0.95",
        )


def build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from loose values, naming bad keys.

    ``prefix`` is the path of this object in the user's config, used in messages.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        name = str(raw_key).replace("-", "_")
        full = f"{prefix}{name}"
        if name not in known:
            raise ConfigError(full, "unknown key", f"use one of: {', '.join(sorted(known))}")
        f = known[name]
        kwargs[name] = _coerce(value, hints[name], f, full)
    missing = [
        n for n, f in known.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}", "is required", f"set {prefix}{missing[0]}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def _coerce(value: Any, hint: Any, f: dataclasses.Field, key: str) -> Any:
    if f.metadata.get("size"):
        return parse_size(value, key)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        return parse_bool(value, key)
    if hint in (int, float):
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ConfigError(key, f"expected a {hint.__name__}, got {value!r}", f"write a {hint.__name__}") from None
    if hint is str:
        return str(value)
    return value


# ---------------------------------------------------------------- store config


@dataclass(frozen=True)
class TierSpec:
    """One configured tier: its registry kind and its own typed config."""

    kind: str
    config: Any


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierSpec, ...]
    chunk_tokens: int = opt(256, "tokens per chunk; a multiple of the engine's block size")
    save_queue_bytes: int = size_field(512 * MiB, "write-through backlog per store; saves beyond it are dropped and counted")
    load_timeout_s: float = opt(10.0, "deadline for one load from a persistent tier; past it the rest is recomputed")
    lookup_timeout_s: float = opt(2.0, "deadline for one batched lookup in a persistent tier")
    breaker_threshold: int = opt(5, "consecutive failures that open a tier's circuit breaker")
    breaker_cooldown_s: float = opt(10.0, "seconds a tripped tier is skipped before one probe call")
    promote: bool = opt(True, "keep chunks loaded from lower tiers in the memory tier")
    buffer_pool_bytes: int = size_field(256 * MiB, "recycled read buffers kept per store (saves page faults on cold reads)")
    node_memory_dir: str = opt("", "tmpfs folder where the vLLM connector keeps memory tiers, one for every process "
                               "of the node (default /dev/shm/kvtier-UID)")

    def validate(self, prefix: str = "") -> None:
        if self.chunk_tokens <= 0:
            raise ConfigError(f"{prefix}chunk_tokens", f"must be positive, got {self.chunk_tokens}", "use e.g. 256")
        if not self.tiers:
            raise ConfigError(f"{prefix}tiers", "no tier configured", "add at least one tier, e.g. tiers: [{kind: memory, capacity: 4GiB}]")
        names = [t.config.name for t in self.tiers]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"{prefix}tiers", f"tier name {sorted(dup)[0]!r} used twice", "give each tier a distinct name: key")
        for kind, label in (("load_timeout_s", "load"), ("lookup_timeout_s", "lookup")):
            if getattr(self, kind) <= 0:
                raise ConfigError(f"{prefix}{kind}", "must be positive", f"set a {label} deadline in seconds, e.g. 5")


def parse_tier(spec: Any, key: str) -> TierSpec:
    """A tier from a mapping (``{kind: disk, path: ..., capacity: ...}``) or a URL
    (``disk:///nvme/kvtier?capacity=500GiB``)."""
    from kvtier.tiers import registry

    if isinstance(spec, str):
        spec = parse_tier_url(spec, key)
    if not isinstance(spec, Mapping):
        raise ConfigError(key, f"expected a mapping or URL, got {type(spec).__name__}", "write e.g. {kind: memory, capacity: 4GiB}")
    values = dict(spec)
    kind = values.pop("kind", None)
    if kind is None:
        raise ConfigError(f"{key}.kind", "is required", f"set kind to one of: {', '.join(registry.kinds())}")
    cfg_cls = registry.config_class(str(kind), f"{key}.kind")
    values.setdefault("name", str(kind))
    return TierSpec(str(kind), build(cfg_cls, values, f"{key}."))


def parse_tier_url(url: str, key: str) -> dict[str, Any]:
    if "://" not in url:
        raise ConfigError(key, f"{url!r} is not a tier URL", "write KIND://LOCATION?option=value, e.g. shared:///mnt/kv?capacity=1TiB")
    kind, rest = url.split("://", 1)
    location, _, query = rest.partition("?")
    values: dict[str, Any] = {"kind": kind}
    if location:
        values["location"] = location
    for part in filter(None, query.split("&")):
        k, sep, v = part.partition("=")
        if not sep:
            raise ConfigError(key, f"option {k!r} in {url!r} has no value", f"write {k}=VALUE")
        values[k] = v
    from kvtier.tiers import registry

    return registry.normalise_url_values(values, key)


def load_file(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("config", f"cannot read {p}: {exc.strerror}", "pass an existing, readable config file") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # any parser error: report it with the file name
        raise ConfigError("config", f"cannot parse {p}: {exc}", "fix the syntax (YAML, TOML or JSON by extension)") from None
    if not isinstance(data, dict):
        raise ConfigError("config", f"{p} does not hold a mapping", "write top-level keys such as tiers:, chunk_tokens:")
    return data


def env_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Values from ``KVTIER_*``: ``KVTIER_TIERS`` (comma-separated tier URLs)
    and ``KVTIER_<FIELD>`` for every scalar field of StoreConfig."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for f in dataclasses.fields(StoreConfig):
        var = f"KVTIER_{f.name.upper()}"
        if var in env:
            out[f.name] = [u for u in env[var].split(",") if u] if f.name == "tiers" else env[var]
    return out


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> StoreConfig:
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = path or env.get("KVTIER_CONFIG")
    if path:
        values.update(load_file(path))
    values.update(env_values(env))
    values.update(overrides or {})
    return parse_store_config(values)


def parse_store_config(values: Mapping[str, Any]) -> StoreConfig:
    values = dict(values)
    raw_tiers = values.get("tiers") or []
    if isinstance(raw_tiers, (str, Mapping)):
        raw_tiers = [raw_tiers]
    values["tiers"] = tuple(parse_tier(t, f"tiers[{i}]") for i, t in enumerate(raw_tiers))
    return build(StoreConfig, values, "")
