"""What the connector needs from vLLM's configuration, read once.

``kv_connector_extra_config`` holds kvtier's own settings: ``config`` (a
kvtier config file), any StoreConfig key inline (``tiers``, ``chunk_tokens``,
...), ``model_fingerprint`` to pin the weights identity explicitly, and
``io_cpus`` to place kvtier's I/O threads in the workers (``parse_io_cpus``).
Inline keys override the file, which overrides ``KVTIER_*`` variables.

The topology decides which tiers each process opens (see ``Topology`` and
docs/vllm.md): ``memory`` tiers become the node's shared memory tier
(``shm``), so that the scheduler, every worker and every other engine of the
node see one host memory; a ``disk`` tier holds one folder per TP rank,
owned by the worker of that rank, which the scheduler reads without owning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.config import StoreConfig, TierSpec, load_config, parse_bool
from kvtier.integrations.vllm import identity
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey, Namespace, shard_key

# vLLM releases whose connector API kvtier is written against: the oldest it
# runs on, and the newest it was checked with (docs/vllm.md says how each
# was checked). Older ones are refused; newer ones start with a warning.
OLDEST_VLLM = (0, 30)
NEWEST_VLLM = (0, 33)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this connector runs in vLLM's process topology.

    Under tensor parallelism each rank holds other KV heads of the same
    tokens: each rank stores and loads only its own shard, under its own key
    (``shard_key``); a chunk is a hit only when every rank's shard is there.
    Where every rank holds the same KV (MLA's latent cache is replicated), a
    chunk is one object, written by rank 0 and read by all.
    """

    tp_size: int
    rank: int | None  # this worker's TP rank; None for the scheduler side
    replicated: bool = False
    heads: int = 1  # KV heads of the whole model (each rank holds heads / tp_size)
    # Other TP sizes whose shards this engine can assemble its own from (a
    # store written at TP=2 read at TP=1, and the reverse): every size that
    # divides the heads (on CPU; see _other_tp_sizes).
    other_tp_sizes: tuple[int, ...] = ()

    @property
    def shard_ranks(self) -> range:
        """The ranks whose objects make up one chunk."""
        return range(1) if self.replicated else range(self.tp_size)

    @property
    def own_shard(self) -> int:
        """The shard this worker reads and writes."""
        assert self.rank is not None, "the scheduler side has no shard"
        return 0 if self.replicated else self.rank

    @property
    def saves(self) -> bool:
        return self.rank is not None and (not self.replicated or self.rank == 0)

    def shard(self, key: ChunkKey, shard: int, tp_size: int | None = None) -> ChunkKey:
        """Shard ``shard`` of chunk ``key`` as written at ``tp_size`` (this engine's by default)."""
        return key if self.replicated else shard_key(key, shard, tp_size or self.tp_size)

    def sources(self, rank: int, tp_size: int) -> range:
        """The shards of a chunk written at ``tp_size`` that hold this
        engine's rank ``rank``'s heads."""
        lo = rank * tp_size // self.tp_size
        hi = ((rank + 1) * tp_size - 1) // self.tp_size
        return range(lo, hi + 1)


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

    @property
    def heads_per_rank(self) -> int:
        t = self.topology
        return t.heads if t.replicated else t.heads // t.tp_size

    def disk_path(self, path: str, shard: int) -> str:
        """The folder of a disk tier that holds ``shard``'s objects."""
        if self.topology.tp_size == 1:
            return path
        return os.path.join(path, f"tp{self.topology.tp_size}-rank{shard}")

    def shard_config(self, shard: int, tp_size: int | None = None) -> StoreConfig:
        """The store of the worker that owns ``shard``: disk tiers in the
        shard's folder, each with its share of the capacity. With another
        ``tp_size`` (shards other engines wrote): no disk tier (a node-local
        folder of another engine's rank), the node memory and shared tiers."""
        n = len(self.topology.shard_ranks)
        tiers = []
        for spec in self.store.tiers:
            if spec.kind == "disk" and tp_size not in (None, self.topology.tp_size):
                continue
            if spec.kind == "disk":
                cfg = replace(spec.config, path=self.disk_path(spec.config.path, shard),
                              capacity=max(1, spec.config.capacity // n))
                spec = TierSpec(spec.kind, cfg)
            tiers.append(spec)
        return replace(self.store, tiers=tuple(tiers))



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


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.32.0+cpu", "0.33.1.dev4+g1a2b")."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM older than the oldest supported release (its connector
    API differs), warn on one newer than the newest checked. The version is
    part of every namespace either way (``layout_name``)."""
    oldest, newest = ".".join(map(str, OLDEST_VLLM)), ".".join(map(str, NEWEST_VLLM))
    rel = _release(version)
    if rel is None or rel < OLDEST_VLLM:
        raise ConfigError("vllm", f"vLLM {version} is older than kvtier supports",
                          f"use vLLM {oldest} to {newest}.x")
    if rel > NEWEST_VLLM:
        log.warning("kvtier: vLLM %s is newer than the newest release kvtier was checked with (%s.x); "
                    "it starts, but report any failure with the vLLM version", version, newest)


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
    fingerprint, extra_tp, io_cpus, decision = keys.model_fingerprint, keys.share_tp_sizes, keys.io_cpus, keys.decision

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
    kv_dtype = str(spec.dtype).removeprefix("torch.")
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        raise ConfigError("pipeline_parallel_size", f"is {pc.pipeline_parallel_size}: each pipeline stage holds other layers",
                          "run kvtier with pipeline_parallel_size 1 (tensor and data parallel are supported)")
    tp = int(pc.tensor_parallel_size)
    replicated = bool(getattr(mc, "use_mla", False))
    heads = int(spec.num_kv_heads) * (1 if replicated else tp)
    others = _other_tp_sizes(tp, heads, replicated, extra_tp)
    topology = Topology(tp, _tp_rank() if worker else None, replicated, heads, others)
    # The namespace is the model's, whatever the TP size: a chunk's shards
    # are named by (TP size, rank) in shard_key, so that engines of other
    # TP sizes can find and assemble them.
    kv_layout = resolved_layout(vllm_config, kv_cache_config)
    ns = Namespace(
        model=identity.model_name(str(mc.model)),
        model_fingerprint=model_fingerprint(vllm_config, fingerprint),
        kv_dtype=kv_dtype,
        layout=layout_name(vllm_config, spec, kv_layout),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=heads,
        head_dim=int(spec.head_size),
        chunk_tokens=store.chunk_tokens,
    )
    return Settings(store, ns, block_size, len(groups[0].layer_names), kv_dtype, topology, kv_layout,
                    awaiting_page=not worker, io_cpus=io_cpus, decision=decision,
                    spin_during_loads=keys.spin_during_loads, load_threads=keys.load_threads)


def parse_io_cpus(value: Any) -> str | frozenset[int]:
    """``io_cpus``: where a worker's kvtier threads (loads, tier I/O, saves) run.

    - ``auto`` (default): on vLLM's CPU backend, which pins every thread of a
      worker to its OpenMP cores (threads inherit that pin), the CPUs of the
      engine process that started the worker; elsewhere as inherited (a GPU
      worker under ``numa_bind`` keeps its NUMA node).
    - ``inherit``: wherever the worker's thread that starts them runs.
    - CPU ids: ``"0-3,8"`` or ``[0, 1, 2, 3, 8]``.
    """
    if isinstance(value, str) and value.strip().lower() in ("auto", "inherit"):
        return value.strip().lower()
    fix = 'write "auto", "inherit", or CPU ids such as "0-3,8"'
    cpus: set[int] = set()
    try:
        parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
        for part in parts:
            lo, _, hi = str(part).strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except (TypeError, ValueError):
        raise ConfigError("io_cpus", f"cannot read CPU ids from {value!r}", fix) from None
    if not cpus:
        raise ConfigError("io_cpus", "names no CPU", fix)
    if hasattr(os, "sched_getaffinity") and not cpus & _allowed_cpus():
        raise ConfigError("io_cpus", f"none of CPUs {cpu_list(cpus)} is available to this process",
                          f"name CPUs among {cpu_list(_allowed_cpus())}")
    return frozenset(cpus)


def _allowed_cpus() -> set[int]:
    """The CPUs this process's engine may use: its parent's (the engine
    process of a worker), else its own."""
    for pid in (os.getppid(), 0):
        try:
            return set(os.sched_getaffinity(pid))
        except OSError:
            continue
    return set(range(os.cpu_count() or 1))


def io_thread_cpus(setting: str | frozenset[int], kv_on_cpu: bool) -> frozenset[int] | None:
    """The CPUs for this worker's kvtier threads under ``setting``; None: as inherited."""
    if isinstance(setting, frozenset):
        return setting
    if setting == "auto" and kv_on_cpu and hasattr(os, "sched_getaffinity"):
        return frozenset(_allowed_cpus())
    return None


def cpu_list(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))


def resolved_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The ``KVCacheLayout`` name vLLM's engine core resolved before building
    connectors (0.30-0.33: on the KV cache config and the cache config)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if name is None:
        return None
    from kvtier.integrations.vllm.layout import LEGACY_NAMES

    name = str(getattr(name, "name", name))  # an enum member in some code paths
    return LEGACY_NAMES.get(name, name)


def _other_tp_sizes(tp: int, heads: int, replicated: bool, wanted) -> tuple[int, ...]:
    """TP sizes besides ``tp`` whose shards can be assembled into ours:
    ``wanted`` (``share_tp_sizes`` in kv_connector_extra_config), or by
    default every size up to 8 that divides the model's KV heads. Every
    page layout keeps heads apart (``PageLayout.head_axis``), but only the
    CPU one has run it end to end, so only there; never for replicated KV
    (one object serves every TP size)."""
    from vllm.platforms import current_platform

    if replicated or current_platform.device_type != "cpu":
        return ()
    if wanted is None:
        wanted = [m for m in (1, 2, 4, 8) if heads % m == 0]
    try:
        sizes = sorted({int(m) for m in wanted})
    except (TypeError, ValueError):
        raise ConfigError("share_tp_sizes", f"expected a list of TP sizes, got {wanted!r}", "write e.g. [1, 2, 4]") from None
    bad = [m for m in sizes if m <= 0 or heads % m]
    if bad:
        raise ConfigError("share_tp_sizes", f"{bad[0]} does not divide the model's {heads} KV heads",
                          f"use sizes that divide {heads}, e.g. {[m for m in (1, 2, 4, 8) if heads % m == 0]}")
    return tuple(m for m in sizes if m != tp)


def node_memory(store: StoreConfig) -> StoreConfig:
    """``memory`` tiers as the node's memory tier (``shm``, same name and
    capacity, in ``node_memory_dir``): a process-local memory is invisible to
    vLLM's other processes and would hold one copy per engine."""
    from kvtier.tiers.shm import ShmConfig, default_dir

    root = store.node_memory_dir or default_dir()
    tiers = []
    for spec in store.tiers:
        if spec.kind == "memory":
            cfg = spec.config
            spec = TierSpec("shm", ShmConfig(capacity=cfg.capacity, name=cfg.name, path=os.path.join(root, cfg.name)))
        tiers.append(spec)
    return replace(store, tiers=tuple(tiers))


def layout_name(vllm_config: Any, spec: Any, kv_layout: str | None) -> str:
    """Names what the scheduler side knows of how a block's bytes are
    arranged: vLLM version, platform, CPU attention kernel variant, block
    size and the resolved ``KVCacheLayout``. The workers add the rest (the
    attention backend they run, kernel blocks per block, the page's axes:
    ``Settings.with_page``). Chunks are whole engine pages copied as opaque
    bytes, so two engines share KV only if their pages are laid out
    identically."""
    import vllm
    from vllm.platforms import current_platform

    device = current_platform.device_type
    variant = "default"
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            variant = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
        except Exception as exc:  # an unknown ISA must not share with a known one
            variant = f"unknown:{type(exc).__name__}"
    return f"vllm{vllm.__version__}/{device}/{variant}/bs{spec.block_size}/{kv_layout or 'unresolved'}"


def model_fingerprint(vllm_config: Any, mode: str | None = None) -> str:
    """Identity of the weights from their content (``identity.py``):
    ``mode`` None samples the weight files, ``"full"`` hashes every byte
    (cached); any other string is the fingerprint itself. A hub id is read
    from the snapshot vLLM downloaded (ConfigError where there is none and
    no commit is pinned)."""
    from kvtier.integrations.vllm import identity

    if mode not in (None, "", "full"):
        return str(mode)
    mc, lc = vllm_config.model_config, vllm_config.load_config
    return identity.fingerprint(
        str(mc.model), revision=mc.revision, load_format=str(getattr(lc, "load_format", "")),
        dtype=str(mc.dtype), quantization=mc.quantization, full=mode == "full",
        download_dir=getattr(lc, "download_dir", None))


def _tp_rank() -> int:
    """The worker's TP rank (vLLM sets up its groups before the connector)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("tensor_parallel_size", "the worker's tensor-parallel group is not set up",
                          "report this vLLM version: kvtier expects its groups before the KV connector")
    return int(parallel_state.get_tensor_model_parallel_rank())
