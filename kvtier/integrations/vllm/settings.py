"""What the connector needs from vLLM's configuration, read once.

``kv_connector_extra_config`` holds kvtier's own settings: ``config`` (a
kvtier config file), any StoreConfig key inline (``tiers``, ``chunk_tokens``,
...), and the connector's own keys (``CONNECTOR_KEYS``): ``model_fingerprint``
to pin the weights identity explicitly, ``io_cpus`` to place kvtier's I/O
threads in the workers (iocpus.py), how hits are weighed against recomputing
them (``LoadDecision``), and more. Inline keys override the file, which
overrides ``KVTIER_*`` variables.

What is read here is put together elsewhere: the process topology and the
tiers each process opens in topology.py, the namespace in namespace.py, the
supported vLLM releases in versions.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.config import StoreConfig, load_config, parse_bool
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.iocpus import parse_io_cpus
from kvtier.integrations.vllm.namespace import engine_namespace, kv_dtype, resolved_layout
from kvtier.integrations.vllm.topology import Topology, engine_topology, node_memory
from kvtier.integrations.vllm.versions import check_vllm_version
from kvtier.keys import Namespace


@dataclass(frozen=True)
class Settings:
    store: StoreConfig  # as configured (memory tiers already node-wide)
    namespace: Namespace  # the TP group's; tenant salt empty (per request via with_salt)
    block_size: int
    num_layers: int
    kv_dtype: str  # kvtier dtype name of the KV cache tensors
    topology: Topology
    kv_layout: str | None = None  # the KVCacheLayout vLLM resolved (None: not told)
    # The scheduler side learns the workers' page layout (backend, kernel
    # split, page axes) from their handshake, after it is built; it claims
    # and saves nothing until then (``with_page``).
    awaiting_page: bool = False
    # Where the worker's kvtier threads run: "auto", "inherit" or CPU ids
    # (parse_io_cpus; applied by the worker once it sees its KV tensors).
    io_cpus: str | frozenset[int] = "auto"
    # How hits are weighed against recomputing them (costs.py).
    decision: "LoadDecision" = field(default_factory=lambda: LoadDecision())
    # Keep vLLM's busy-wait for its workers' replies while kvtier loads
    # (enginewait.py; by default the engine core blocks instead).
    spin_during_loads: bool = False
    # Asynchronous loads a worker reads at once, the rest queued in the
    # order they were claimed (worker.py). One: each load has the device to
    # itself and the loads of a burst end one after another, the first
    # soon, instead of all near the end of the burst.
    load_threads: int = 1

    def with_page(self, page: str) -> "Settings":
        """These settings with the workers' page layout in the namespace."""
        return replace(self, namespace=replace(self.namespace, layout=f"{self.namespace.layout}/{page}"),
                       awaiting_page=False)


@dataclass(frozen=True)
class LoadDecision:
    """How the scheduler weighs a hit's load against recomputing it (costs.py).

    ``mode``: ``auto`` claims only what loads faster than prefill computes;
    ``always`` claims every hit. The seeds stand in for measurements until
    the engine has made its own: ``prefill_tokens_per_s``, and per tier name
    ``read_rates`` in bytes per second. A tier ruled out is re-measured in
    the background (one chunk read) every ``probe_interval_s``."""

    mode: str = "auto"
    prefill_tokens_per_s: float | None = None
    read_rates: tuple[tuple[str, float], ...] = ()
    probe_interval_s: float = 30.0


# The vLLM connector's own keys (not the store's): inline in
# kv_connector_extra_config, or in the config file's ``vllm:`` section.
SECTION = "vllm"
CONNECTOR_KEYS = ("model_fingerprint", "share_tp_sizes", "io_cpus", "load_decision", "prefill_tokens_per_s",
                  "read_rates", "probe_interval_s", "spin_during_loads", "load_threads")


@dataclass(frozen=True)
class ConnectorKeys:
    model_fingerprint: str | None = None
    share_tp_sizes: Any = None
    io_cpus: str | frozenset[int] = "auto"
    decision: LoadDecision = field(default_factory=LoadDecision)
    spin_during_loads: bool = False
    load_threads: int = 1


def connector_section(path: str | None, environ=os.environ) -> dict:
    """The ``vllm:`` section of the config file (``path``, else ``KVTIER_CONFIG``)."""
    from kvtier.config import load_file

    path = path or environ.get("KVTIER_CONFIG")
    if not path:
        return {}
    section = load_file(path).get(SECTION) or {}
    if not isinstance(section, dict):
        raise ConfigError(SECTION, f"expected a mapping of connector keys, got {section!r}",
                          f"write e.g. {SECTION}: {{load_decision: auto}}")
    return dict(section)


def parse_connector_keys(own: dict, tier_names: list[str]) -> ConnectorKeys:
    """Check the connector's own keys; an unknown one is named with the known ones."""
    own = dict(own)
    unknown = sorted(set(own) - set(CONNECTOR_KEYS))
    if unknown:
        raise ConfigError(f"{SECTION}.{unknown[0]}", "unknown key", f"use one of: {', '.join(CONNECTOR_KEYS)}")
    fingerprint = own.pop("model_fingerprint", None)
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ConfigError(f"{SECTION}.model_fingerprint", f"expected a string, got {fingerprint!r}",
                          'write "full", or a string that names these weights (e.g. the hub commit)')
    spin = parse_bool(own.pop("spin_during_loads", False), f"{SECTION}.spin_during_loads")
    threads = own.pop("load_threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ConfigError(f"{SECTION}.load_threads", f"expected a whole number from 1 to 64, got {threads!r}",
                          "write e.g. load_threads: 1 (loads read at once; the rest wait their turn)")
    return ConnectorKeys(None if fingerprint is None else str(fingerprint), own.pop("share_tp_sizes", None),
                         parse_io_cpus(own.pop("io_cpus", "auto")), parse_load_decision(own, tier_names), spin,
                         threads)


def parse_load_decision(extra: dict, tier_names: list[str]) -> LoadDecision:
    """The decision keys of ``kv_connector_extra_config`` (removed from it)."""
    from kvtier.config import parse_size

    mode = str(extra.pop("load_decision", "auto")).strip().lower()
    if mode not in ("auto", "always"):
        raise ConfigError("load_decision", f"is {mode!r}", 'write "auto" (load only what beats recompute) or "always"')
    prefill = _positive(extra.pop("prefill_tokens_per_s", None), "prefill_tokens_per_s", "tokens per second, e.g. 5000")
    probe = _positive(extra.pop("probe_interval_s", 30.0), "probe_interval_s", "seconds, e.g. 30")
    rates = extra.pop("read_rates", None) or {}
    if not isinstance(rates, dict):
        raise ConfigError("read_rates", f"expected a mapping of tier names to bytes per second, got {rates!r}",
                          'write e.g. {"shared": "2GB"}')
    seeds = []
    for name, rate in rates.items():
        if name not in tier_names:
            raise ConfigError(f"read_rates.{name}", "names no configured tier", f"use one of: {', '.join(tier_names)}")
        value = parse_size(rate, f"read_rates.{name}")
        if value <= 0:
            raise ConfigError(f"read_rates.{name}", "must be positive", 'write bytes per second, e.g. "2GB"')
        seeds.append((str(name), float(value)))
    return LoadDecision(mode, prefill, tuple(seeds), probe)


def _positive(value: Any, key: str, fix: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a number, got {value!r}", fix)
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected a number, got {value!r}", fix) from None
    if not (x > 0) or x == float("inf"):
        raise ConfigError(key, f"must be a positive finite number, got {value!r}", fix)
    return x


def load_settings(vllm_config: Any, kv_cache_config: Any, worker: bool) -> Settings:
    import vllm

    check_vllm_version(vllm.__version__)
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
        raise ConfigError(
            "kv_transfer_config.kv_load_failure_policy",
            f"is {ktc.kv_load_failure_policy!r}: a cache miss during a load would fail the request",
            'add "kv_load_failure_policy": "recompute" to --kv-transfer-config',
        )
    extra = dict(ktc.kv_connector_extra_config or {})
    path = extra.pop("config", None)
    # The connector's own keys: the config file's ``vllm:`` section, then the
    # same section inline (``kvtier serve --inline``), then top-level inline keys.
    inline = extra.pop(SECTION, None) or {}
    if not isinstance(inline, dict):
        raise ConfigError(f"kv_connector_extra_config.{SECTION}", f"expected a mapping of connector keys, got {inline!r}",
                          f'write e.g. "{SECTION}": {{"load_decision": "auto"}}')
    own = {**connector_section(path), **inline, **{k: extra.pop(k) for k in CONNECTOR_KEYS if k in extra}}
    store = node_memory(load_config(path, overrides=extra))
    keys = parse_connector_keys(own, [t.config.name for t in store.tiers])

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            "model", f"{len(groups)} KV cache groups (hybrid attention)", "kvtier supports models with one KV cache group"
        )
    spec = groups[0].kv_cache_spec
    block_size = int(spec.block_size)
    if store.chunk_tokens % block_size:
        raise ConfigError(
            "chunk_tokens",
            f"{store.chunk_tokens} is not a multiple of the engine's block size {block_size}",
            f"set chunk_tokens to a multiple of {block_size}, e.g. {max(1, 256 // block_size) * block_size}",
        )
    topology = engine_topology(vllm_config, spec, worker, keys.share_tp_sizes)
    kv_layout = resolved_layout(vllm_config, kv_cache_config)
    ns = engine_namespace(vllm_config, kv_cache_config, kv_layout, store.chunk_tokens, topology.heads,
                          keys.model_fingerprint)
    return Settings(store, ns, block_size, len(groups[0].layer_names), kv_dtype(spec), topology, kv_layout,
                    awaiting_page=not worker, io_cpus=keys.io_cpus, decision=keys.decision,
                    spin_during_loads=keys.spin_during_loads, load_threads=keys.load_threads)
