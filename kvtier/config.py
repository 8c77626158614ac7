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
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# The typed keys' kit, re-exported: a tier written outside kvtier imports
# ``opt`` and ``size_field`` from here (configfields says why they live there).
from kvtier.configfields import (  # noqa: F401
    GiB,
    MiB,
    build,
    check_watermarks,
    fmt_bytes,
    opt,
    parse_bool,
    parse_size,
    size_field,
)
from kvtier.configfields import describe_value
from kvtier.errors import ConfigError


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
        raise ConfigError("config", f"expected the path of a config file, got {describe_value(path)}",
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
        raise ConfigError("tiers", f"expected a list of tiers, got {describe_value(raw_tiers)}",
                          "write e.g. tiers: [{kind: memory, capacity: 4GiB}], or tier URLs")
    values["tiers"] = tuple(parse_tier(t, f"tiers[{i}]") for i, t in enumerate(raw_tiers))
    if environ is not None:
        values["tiers"] = tuple(with_env_secrets(t, environ) for t in values["tiers"])
    return build(StoreConfig, values, "")
