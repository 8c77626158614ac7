"""The configuration ``kvtier check`` checks, read as the engine reads it.

Two ways in, as in a deployment:

- ``--config FILE`` (or ``KVTIER_CONFIG``): what ``kvtier serve`` gives the
  engine (``kv_connector_extra_config: {"config": FILE}``);
- ``--kv-transfer-config JSON``: the very argument vLLM gets; its
  ``kv_connector_extra_config`` is read as the connector reads it
  (``integrations/vllm/settings.py``, ``load_settings``): ``config`` names
  the file, ``vllm`` and the connector's keys are the connector's own, every
  other key overrides the file.

Either way ``KVTIER_*`` variables apply beneath, as the engine, which
inherits this environment, would see them. A value that does not parse is
one FAIL row naming the key and the fix, and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Any, Mapping

from kvtier.check.report import Report
from kvtier.config import (SECRET_ENV, SECRET_KEYS, StoreConfig, env_values, fmt_bytes, load_config, load_file,
                           unknown_env)
from kvtier.errors import ConfigError

# Environment variables outside kvtier's own that hold credentials the
# tiers' clients read (boto3's chain).
_OTHER_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def read(report: Report, config_path: str | None, kv_transfer_config: str | None,
         environ: Mapping[str, str]) -> StoreConfig | None:
    """The store configuration, with a row for where it came from; None
    (and ``report.config_unreadable``) where it does not parse."""
    _env_secrets(report, environ)
    unknown = unknown_env(environ)
    for var, message in unknown:
        report.warn(f"env {var}", message, f"unset {var}, or correct its name")
    # Variables kvtier does not read change nothing; left out, load_config
    # does not log what the rows above already say.
    env = {k: v for k, v in environ.items() if k not in dict(unknown)}
    try:
        if kv_transfer_config is not None:
            path, overrides, inline = _connector_json(report, kv_transfer_config)
        else:
            path, overrides, inline = config_path, {}, {}
        path = path or env.get("KVTIER_CONFIG") or None
        if path:
            _file_secrets(report, load_file(path))
        store = load_config(path, overrides=overrides, environ=env)
        _tier_secrets(report, store)
        from kvtier.integrations.vllm.settings import connector_section, parse_connector_keys

        # The connector's own keys: the file's section, then inline ones.
        parse_connector_keys({**connector_section(path, env), **inline}, [t.config.name for t in store.tiers])
    except ConfigError as exc:
        report.fail("config", f"key '{exc.key}': {exc.problem}", exc.fix)
        report.config_unreadable = True
        return None
    report.ok("config", _describe(path, overrides, env, store))
    if path:
        _config_file(report, str(path))
    return store


def _describe(path, overrides: dict, env: Mapping[str, str], store: StoreConfig) -> str:
    parts = [str(path) if path else "no config file"]
    from_env = [f"KVTIER_{k.upper()}" for k in env_values(env)]
    if from_env:
        parts.append("environment " + ", ".join(from_env))
    if overrides:
        parts.append("kv_connector_extra_config " + ", ".join(sorted(overrides)))
    tiers = []
    for spec in store.tiers:
        where = getattr(spec.config, "path", "") or getattr(spec.config, "address", "") or getattr(spec.config, "location", "")
        tiers.append(f"{spec.config.name} ({spec.kind}, {fmt_bytes(spec.config.capacity)}{', ' + where if where else ''})")
    return f"{' + '.join(parts)}: chunk_tokens {store.chunk_tokens}; tiers {'; '.join(tiers)}"


# ------------------------------------------------------------ --kv-transfer-config


def _connector_json(report: Report, text: str) -> tuple[str | None, dict, dict]:
    """Check the JSON vLLM gets; (config file, store overrides, the
    connector's keys given inline)."""
    from kvtier.integrations.vllm.settings import CONNECTOR_KEYS, SECTION
    from kvtier.serve import CONNECTOR, CONNECTOR_MODULE

    key = "--kv-transfer-config"
    try:
        ktc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(key, f"is not JSON ({exc})", "pass the JSON object vLLM gets, in single quotes") from None
    if not isinstance(ktc, dict):
        raise ConfigError(key, f"expected a JSON object, got {type(ktc).__name__}",
                          f'write e.g. {{"kv_connector": "{CONNECTOR}", ...}}')
    extra = ktc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", f"expected a JSON object, got {type(extra).__name__}",
                          'write e.g. {"config": "/etc/kvtier/kvtier.yaml"}')
    _file_secrets(report, extra)
    _connector_fields(report, ktc, CONNECTOR, CONNECTOR_MODULE)
    _inline_credentials(report, extra)
    extra = dict(extra)
    path = extra.pop("config", None)
    if path is not None and not isinstance(path, str):
        raise ConfigError("kv_connector_extra_config.config", f"expected the path of a config file, got {path!r}",
                          'write e.g. "config": "/etc/kvtier/kvtier.yaml"')
    inline = extra.pop(SECTION, None) or {}
    if not isinstance(inline, dict):
        raise ConfigError(f"kv_connector_extra_config.{SECTION}", f"expected a mapping of connector keys, got {inline!r}",
                          f'write e.g. "{SECTION}": {{"load_decision": "auto"}}')
    return path, extra, {**inline, **{k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}}


def _connector_fields(report: Report, ktc: dict, connector: str, module: str) -> None:
    """What vLLM needs to load kvtier, and what kvtier's connector refuses."""
    name = "kv_transfer_config"
    found = len(report.rows)
    if ktc.get("kv_connector") != connector:
        report.fail(name, f"kv_connector is {_shown(ktc, 'kv_connector')}: vLLM would not load kvtier",
                    f'set "kv_connector": "{connector}"')
    if ktc.get("kv_connector_module_path") != module:
        report.fail(name, f"kv_connector_module_path is {_shown(ktc, 'kv_connector_module_path')}: vLLM does not "
                    "know kvtier's connector by name", f'set "kv_connector_module_path": "{module}"')
    role = ktc.get("kv_role")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        report.fail(name, f"kv_role is {_shown(ktc, 'kv_role')}: vLLM refuses it with a connector", 'set "kv_role": "kv_both"')
    elif role != "kv_both":
        report.warn(name, f"kv_role is {role!r}: vLLM schedules the connector as a {role[3:]} only, while kvtier "
                    "both saves and loads", 'set "kv_role": "kv_both"')
    policy = ktc.get("kv_load_failure_policy", "fail")
    if policy != "recompute":
        report.fail(name, f"kv_load_failure_policy is {policy!r}: the connector refuses to start, since a miss "
                    "during a load would fail the request", 'set "kv_load_failure_policy": "recompute"')
    if len(report.rows) == found:
        report.ok(name, f"{connector} from {module}, {role}, recompute what fails to load")


def _shown(ktc: dict, key: str) -> str:
    return repr(ktc[key]) if key in ktc else "missing"


def _inline_credentials(report: Report, extra: dict) -> None:
    from kvtier.serve import _secret_paths

    found = sorted(_secret_paths(extra))
    if found:
        report.fail("kv_connector_extra_config", f"holds a credential ({found[0]}): vLLM prints this mapping "
                    "in its start-up log", "move credentials to the config file (readable only by the service "
                    "user) or to KVTIER_* variables, and name the file with \"config\"")


# ------------------------------------------------------------ the config file


def _config_file(report: Report, path: str) -> None:
    """Who may change the file (and so where the engine's tiers are, and
    whether it checks seals), and who may read its credentials."""
    from kvtier.serve import _secret_paths

    try:
        st = os.stat(path)
    except OSError as exc:
        report.fail("config file", f"cannot stat {path}: {exc.strerror}", "name a readable config file")
        return
    mode = stat.S_IMODE(st.st_mode)
    creds = sorted(_secret_paths(load_file(path)))
    if mode & 0o002:
        report.fail("config file", f"{path} is writable by every user (mode {mode:04o}): anyone on the node can "
                    "change where the engine reads KV from", f"chmod o-w {path}")
    elif creds and mode & 0o004:
        report.fail("config file", f"{path} holds a credential ({creds[0]}) and every user can read it "
                    f"(mode {mode:04o})", f"chmod 600 {path} (or 640, the service user's group reading)")
    elif mode & 0o020:
        report.warn("config file", f"{path} is writable by its group (mode {mode:04o})",
                    f"chmod g-w {path}, unless every member of group {st.st_gid} may run the engine")
    else:
        report.ok("config file", f"{path}: mode {mode:04o}, owner uid {st.st_uid}"
                  + (f"; holds credentials ({', '.join(creds[:3])}{', ...' if len(creds) > 3 else ''})" if creds else ""))


# ------------------------------------------------------------ secrets


def _env_secrets(report: Report, environ: Mapping[str, str]) -> None:
    prefixes = tuple(v for kind in SECRET_ENV.values() for v in kind.values()) + _OTHER_SECRET_ENV
    for var, value in environ.items():
        if var.startswith(prefixes):
            report.secret(value)


def _file_secrets(report: Report, values: Any) -> None:
    """Credentials written in a config mapping (``password:`` ...), even
    where the rest of it does not parse."""
    if isinstance(values, dict):
        for k, v in values.items():
            if k in SECRET_KEYS:
                report.secret(v if isinstance(v, str) else None)
            _file_secrets(report, v)
    elif isinstance(values, list):
        for v in values:
            _file_secrets(report, v)
    elif isinstance(values, str) and "://" in values and "?" in values:
        # A tier URL's options: ...?password=...
        for part in values.split("?", 1)[1].split("&"):
            k, _, v = part.partition("=")
            if k in SECRET_KEYS:
                report.secret(v)


def _tier_secrets(report: Report, store: StoreConfig) -> None:
    """Every field a tier's config keeps out of its repr is a secret (a
    plugin tier's too)."""
    for spec in store.tiers:
        for f in dataclasses.fields(spec.config):
            if not f.repr:
                report.secret(getattr(spec.config, f.name))
