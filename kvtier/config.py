"""Typed, frozen configuration, parsed once at the edge.

Precedence: a config file (YAML, TOML or JSON) < environment ``KVTIER_*`` <
explicit overrides (CLI flags, vLLM's ``kv_connector_extra_config``). Tiers get
their own config objects and never read the environment themselves.

Every error names the key and the fix (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
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

# A number, then a unit: K, M, G, T, P with an optional "i" and/or "B"
# ("8G", "8Gi" and "8GiB" are binary, "8GB" decimal), or "B" alone (bytes).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i|ib|b)?|(b))\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE_FIX = "write a size with its unit, such as 8GiB, 512MiB, 10GB or 4096B"


def parse_size(value: Any, key: str) -> int:
    """Bytes from ``"512MiB"``, ``"8G"`` or ``"8GiB"`` (binary), ``"10GB"``
    (decimal) or ``"4096B"`` (bytes). A number without its unit is refused
    (``20`` could mean bytes or GiB; only ``0`` means the same in every
    unit), as is anything that is not a finite size."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(key, f"expected a size, got {value!r}", _SIZE_FIX)
    if isinstance(value, (int, float)) or (isinstance(value, str) and _NUMBER.match(value)):
        number = value if isinstance(value, int) else float(value)
        if number == 0:
            return 0
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(key, f"size {value!r} is not a finite number of bytes", _SIZE_FIX)
        if number < 0:
            raise ConfigError(key, f"size {value!r} is negative", "use a positive size")
        shown = str(value).strip()
        fix = (f"write the unit, e.g. {shown}GiB, {shown}MB, or {shown}B for bytes"
               if re.fullmatch(r"\d+(\.\d+)?", shown) else _SIZE_FIX)
        raise ConfigError(key, f"size {shown!r} has no unit", fix)
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a size, got {type(value).__name__} {value!r}", _SIZE_FIX)
    m = _SIZE.match(value)
    if not m:
        if value.strip().startswith("-"):
            raise ConfigError(key, f"size {value!r} is negative", "use a positive size")
        raise ConfigError(key, f"cannot read size {value!r}", _SIZE_FIX)
    unit, suffix = (m.group(2) or "").lower(), (m.group(3) or "").lower()
    n = float(m.group(1)) * (1000 if suffix == "b" else 1024) ** _UNITS[unit]
    if not math.isfinite(n):
        raise ConfigError(key, f"size {value!r} is not a finite number of bytes", _SIZE_FIX)
    return int(n)


_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$|^\s*[-+]?(inf|infinity|nan)\s*$", re.IGNORECASE)


def fmt_bytes(n: float) -> str:
    """A byte count for people: ``3.5 GiB``, ``512 B`` (binary units)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


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


def opt(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None) -> Any:
    """A config key: its default, its one-line doc, and its range (``ge``:
    at least; ``gt``: greater than), which ``build`` checks for every key."""
    meta: dict[str, Any] = {"doc": doc}
    if ge is not None:
        meta["ge"] = ge
    if gt is not None:
        meta["gt"] = gt
    return field(default=default, metadata=meta)


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
        _check_range(kwargs[name], f, full)
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


def _check_range(value: Any, f: dataclasses.Field, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}", f"set {key} to a number of {_unit(key)}")
    ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
    if ge is not None and value < ge:
        raise ConfigError(key, f"must be at least {ge:g}, got {value!r}", f"set {key} to {ge:g} or more")
    if gt is not None and value <= gt:
        raise ConfigError(key, f"must be greater than {gt:g}, got {value!r}", f"set {key} to more than {gt:g}")


def _unit(key: str) -> str:
    return "seconds" if key.endswith("_s") else "units, e.g. 1"


def _coerce(value: Any, hint: Any, f: dataclasses.Field, key: str) -> Any:
    """``value`` as the type of its key. Strings are read (environment
    variables and URL options are text); other types are taken only where
    nothing is lost or guessed: no bool for a number (``True`` is an int in
    Python), no fraction for an integer, nothing but a string for a string."""
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
        return _number(value, hint, key)
    if hint is str:
        if isinstance(value, str):
            return value
        # A number is refused too: YAML reads 0123 as 83 and 1e3 as text,
        # so what it made of an unquoted value is not what was written.
        shown = _shown(value) if f.repr else f"a {type(value).__name__} (a secret's value is never shown)"
        raise ConfigError(key, f"expected a string, got {shown}",
                          f"write {key} as a string (in quotes if it looks like a number), or leave it out for its default")
    return value


def _number(value: Any, hint: type, key: str) -> int | float:
    word = "a whole number" if hint is int else "a number"
    if isinstance(value, str):
        try:
            return hint(value.strip())
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return hint(value)
    elif isinstance(value, float) and (hint is float or value.is_integer()):
        return hint(value)
    raise ConfigError(key, f"expected {word}, got {_shown(value)}", f"write {word} for {key}")


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int, float)) or value is None else f"{type(value).__name__} {value!r}"


# A tier's name becomes a folder's name (the node memory tier's), a metrics
# label and an environment variable's suffix: letters, digits, "_", "-" and
# ".", never a path.
_TIER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_tier_name(name: str, key: str) -> None:
    if not _TIER_NAME.fullmatch(name):
        raise ConfigError(key, f"tier name {name!r} is not a plain name",
                          "use up to 64 letters, digits, '_', '-' and '.', starting with a letter, digit or '_'")


# ---------------------------------------------------------------- store config


@dataclass(frozen=True)
class TierSpec:
    """One configured tier: its registry kind and its own typed config."""

    kind: str
    config: Any


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierSpec, ...]
    chunk_tokens: int = opt(256, "tokens per chunk; a multiple of the engine's block size", gt=0)
    save_queue_bytes: int = size_field(512 * MiB, "write-through backlog per store; saves beyond it are dropped and counted")
    load_timeout_s: float = opt(10.0, "deadline for one load from a persistent tier; past it the rest is recomputed", gt=0)
    lookup_timeout_s: float = opt(2.0, "deadline for one batched lookup in a persistent tier", gt=0)
    breaker_threshold: int = opt(5, "consecutive failures that open a tier's circuit breaker", ge=1)
    breaker_cooldown_s: float = opt(10.0, "seconds a tripped tier is skipped before one probe call", ge=0)
    promote: bool = opt(True, "keep chunks loaded from lower tiers in the memory tier")
    buffer_pool_bytes: int = size_field(256 * MiB, "recycled read buffers kept per store (saves page faults on cold reads)")
    huge_pages: bool = opt(True, "read buffers of 2 MiB or more on transparent huge pages: O_DIRECT reads go to the "
                           "device as whole-object requests, at less kernel CPU (no effect where THP is off)")
    auth_key_file: str = opt("", "file of cluster keys (kvtier auth keygen): objects are sealed with its first key and "
                             "served only if sealed with one of its keys; empty: no authentication (docs/security.md)")
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
    (``disk:///nvme/kvtier?capacity=500GiB``). ``kind`` may name a tier another
    package provides, or a tier class (``package.module:Class``): see
    ``tiers/registry.py``."""
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
    values.setdefault("name", registry.default_name(str(kind)))
    cfg = build(cfg_cls, values, f"{key}.")
    check_tier_name(str(cfg.name), f"{key}.name")
    return TierSpec(str(kind), cfg)


def parse_tier_url(url: str, key: str) -> dict[str, Any]:
    """The values of a tier URL. Credentials are refused here (see
    ``SECRET_KEYS``); an error never repeats one (``redact_url``)."""
    if "://" not in url:
        raise ConfigError(key, f"{redact_url(url)!r} is not a tier URL",
                          "write KIND://LOCATION?option=value, e.g. shared:///mnt/kv?capacity=1TiB")
    kind, rest = url.split("://", 1)
    location, _, query = rest.partition("?")
    values: dict[str, Any] = {"kind": kind}
    if location:
        values["location"] = location
    for part in filter(None, query.split("&")):
        k, sep, v = part.partition("=")
        if k.replace("-", "_") in SECRET_KEYS:
            continue  # refused below, once the kind is known (the fix names its variable)
        if not sep:
            raise ConfigError(key, f"option {k!r} in {redact_url(url)!r} has no value", f"write {k}=VALUE")
        values[k] = v
    values = _normalise_url_values(values, key)
    for part in filter(None, query.split("&")):
        name = part.partition("=")[0].replace("-", "_")
        if name in SECRET_KEYS:
            raise ConfigError(f"{key}.{name}", "is a credential, and a tier URL is no place for one (URLs are "
                              "printed, logged and seen in process lists)", _secret_fix(values["kind"], name))
    return values


def _normalise_url_values(values: dict[str, Any], key: str) -> dict[str, Any]:
    """A tier URL's values as a tier mapping: the kind its scheme names, TLS
    where the scheme asks for it, the location in the kind's own field."""
    from kvtier.tiers import registry

    scheme = values["kind"]
    kind, tls, field = registry.url_kind(scheme, key)
    if tls:
        if not parse_bool(values.get("tls", True), f"{key}.tls"):
            raise ConfigError(f"{key}.tls", f"{scheme}:// always connects with TLS",
                              f"drop tls=false, or write {kind}:// for a plain connection")
        values["tls"] = True
    values["kind"] = kind
    location = values.pop("location", None)
    if location is not None:
        if field is None:
            raise ConfigError(key, f"tier kind {kind!r} takes no location ({redact_url(location)!r})",
                              f"write {kind}://?capacity=...")
        values[field] = location
    return values


# Tier keys that are credentials: never taken from a tier URL, never put on
# a command line (``kvtier serve --inline``), never shown.
SECRET_KEYS = frozenset({"password", "username", "access_key_id", "secret_access_key"})


def _secret_fix(kind: str, name: str) -> str:
    var = SECRET_ENV.get(kind, {}).get(name)
    where = f"{name}: in the tier's entry of the kvtier config file (readable only by kvtier's user)"
    if var is None:
        return f"drop it from the URL; set {where}"
    return f"drop it from the URL; set {var} (or {var}_<TIER NAME> for one tier) in the environment, or {where}"


def redact_url(url: str) -> str:
    """``url`` for messages and reports: a ``user:secret@`` part and the
    values of credential options replaced by ``***``."""
    scheme, sep, rest = url.partition("://") if "://" in url else ("", "", url)
    location, q, query = rest.partition("?")
    _, at, host = location.rpartition("@")
    if at:
        location = "***@" + host
    opts = []
    for part in query.split("&") if q else ():
        k, eq, v = part.partition("=")
        if k.replace("-", "_") in SECRET_KEYS:
            v = "***"
        elif "@" in v and "://" in v:  # an endpoint URL with user:secret@
            v = redact_url(v)
        opts.append(k + eq + v)
    return f"{scheme}{sep}{location}" + (q + "&".join(opts) if q else "")


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


log = logging.getLogger(__name__)

# Tier secrets from the environment (never a file, never a command line):
# VAR applies to every tier of its kind that sets no value itself; VAR_<NAME>
# (the tier's name, upper case, "-" as "_") to that tier alone, first.
SECRET_ENV = {
    "redis": {"password": "KVTIER_REDIS_PASSWORD", "username": "KVTIER_REDIS_USERNAME"},
    "s3": {"access_key_id": "KVTIER_S3_ACCESS_KEY_ID", "secret_access_key": "KVTIER_S3_SECRET_ACCESS_KEY"},
}
_URL_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def split_tier_urls(text: str) -> list[str]:
    """``KVTIER_TIERS``: tier URLs separated by commas. A comma followed by
    something that is not a new ``kind://`` belongs to the URL before it (a
    Redis tier's node list: ``redis://h1:6379,h2:6379?cluster=true``)."""
    out: list[str] = []
    for part in text.split(","):
        if out and not _URL_START.match(part.strip()):
            out[-1] += "," + part
        elif part.strip():
            out.append(part.strip())
    return out


def env_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Values from ``KVTIER_*``: ``KVTIER_TIERS`` (comma-separated tier URLs)
    and ``KVTIER_<FIELD>`` for every scalar field of StoreConfig."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for f in dataclasses.fields(StoreConfig):
        var = f"KVTIER_{f.name.upper()}"
        if var in env:
            out[f.name] = split_tier_urls(env[var]) if f.name == "tiers" else env[var]
    return out


def known_env_names() -> list[str]:
    names = ["KVTIER_CONFIG"] + [f"KVTIER_{f.name.upper()}" for f in dataclasses.fields(StoreConfig)]
    return names + [v for kind in SECRET_ENV.values() for v in kind.values()]


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, message) for each ``KVTIER_*`` variable kvtier does not
    read (a typo is otherwise silently ignored), naming the closest one it
    does. ``KVTIER_TEST_*`` belongs to kvtier's own test suite."""
    known = known_env_names()
    secret_prefixes = tuple(v + "_" for kind in SECRET_ENV.values() for v in kind.values())
    out = []
    for var in sorted(environ):
        if (not var.startswith("KVTIER_") or var in known or var.startswith(secret_prefixes)
                or var.startswith("KVTIER_TEST_")):
            continue
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        out.append((var, f"{var} is not a kvtier setting and is ignored" + (f"; did you mean {close[0]}?" if close else "")))
    return out


def warn_unknown_env(environ: Mapping[str, str]) -> list[str]:
    """Warn once per variable ``unknown_env`` names. Returns the warnings."""
    out = []
    for var, msg in unknown_env(environ):
        if var in _warned:
            continue
        _warned.add(var)
        log.warning("%s", msg)
        out.append(msg)
    return out


_warned: set[str] = set()


def with_env_secrets(spec: TierSpec, env: Mapping[str, str]) -> TierSpec:
    """``spec`` with the secrets its config leaves empty filled from
    ``SECRET_ENV`` (checked again, as ``build`` checks a config)."""
    cfg = spec.config
    changes = {}
    for field_name, var in SECRET_ENV.get(spec.kind, {}).items():
        if getattr(cfg, field_name, None):
            continue
        own = f"{var}_{cfg.name.upper().replace('-', '_')}"
        value = env.get(own) or env.get(var)
        if value:
            changes[field_name] = value
    if not changes:
        return spec
    filled = dataclasses.replace(cfg, **changes)
    validate = getattr(filled, "validate", None)
    if validate is not None:
        validate(f"tiers[{cfg.name}].")
    return TierSpec(spec.kind, filled)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> StoreConfig:
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = path or env.get("KVTIER_CONFIG")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError("config", f"expected the path of a config file, got {_shown(path)}",
                          "write the file's path, e.g. /etc/kvtier.yaml")
    if path:
        values.update(load_file(path))
    values.update(env_values(env))
    values.update(overrides or {})
    warn_unknown_env(env)
    return parse_store_config(values, env)


def parse_store_config(values: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> StoreConfig:
    """``environ``: where tier secrets left empty come from (``SECRET_ENV``);
    None takes none."""
    values = dict(values)
    # The vLLM connector's own section (integrations/vllm/settings.py reads
    # and checks it): not a store key.
    values.pop("vllm", None)
    raw_tiers = values.get("tiers")
    if raw_tiers is None:
        raw_tiers = []
    elif isinstance(raw_tiers, (str, Mapping)):
        raw_tiers = [raw_tiers]
    elif not isinstance(raw_tiers, (list, tuple)):
        raise ConfigError("tiers", f"expected a list of tiers, got {_shown(raw_tiers)}",
                          "write e.g. tiers: [{kind: memory, capacity: 4GiB}], or tier URLs")
    values["tiers"] = tuple(parse_tier(t, f"tiers[{i}]") for i, t in enumerate(raw_tiers))
    if environ is not None:
        values["tiers"] = tuple(with_env_secrets(t, environ) for t in values["tiers"])
    return build(StoreConfig, values, "")
