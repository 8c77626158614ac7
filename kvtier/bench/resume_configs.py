"""What ``kvtier bench resume`` runs: its settings (``ResumeConfig``), the
configurations it compares, and what each one's engine processes are given
(``engine_spec``: the model length and block budget, the kvtier tiers, the
connector, and what a cold phase drops). ``kvtier.bench.resume`` runs them.

    recompute          no connector, no prefix cache
    prefix-cache       no connector, vLLM's prefix cache only
    kvtier-memory      kvtier, memory tier
    kvtier-disk        kvtier, local disk tier
    kvtier-shared      kvtier, shared-directory tier, page cache dropped (cold reads)
    kvtier-shared-buffered, kvtier-shared-direct, kvtier-shared-aio
                       the same tier always read one way: buffered with
                       readahead (o_direct: false), O_DIRECT from a thread per
                       read (aio: false), O_DIRECT through native AIO from one
                       driver thread (the default, spelled out)
    kvtier-shared-4k   the default path with its read buffers on 4 KiB pages
                       (the store's huge_pages: false)
    kvtier-shared-w6, kvtier-shared-w16, kvtier-shared-w32, kvtier-shared-w128
                       the default path with a 6, 16, 32 or 128 MiB read window
                       (read_window_bytes)
    example            vLLM's built-in ExampleConnector (disk), the peer baseline;
                       its files are dropped from the page cache like the shared tier's
    kvtier-local-disk  W3 only: each instance has a disk tier of its own (the
                       "one local NVMe per server" baseline)
    kvtier-local-drive W1 swept over concurrency: a disk tier on a modelled local
                       drive, the same device read through the kernel's block
                       throttle at --local-ratio of the rate fio measured on
                       it in the same run (blkio.py)
    kvtier-shared-pairs, kvtier-shared-fair
                       the shared tier with its loads read two at a time
                       (load_threads 2), or all at once sharing the device
                       (load_threads 64); the default reads one at a time,
                       in the order they were claimed
    kvtier-staged      kvtier, a memory tier of --staging bytes above the shared
                       tier, smaller than what a burst loads at once (both
                       tiers' copies dropped before each cold phase): every
                       load must be served through a staging tier it overflows
    kvtier-throttled   kvtier, shared tier on a FUSE mount (faultfs) whose reads
                       are held to --throttle bytes/s: storage slower than the
                       engine's prefill; compared with recompute (a hit must
                       never be slower than recomputing it)
    lmcache            LMCache's vLLM connector, CPU backend    } CUDA hosts only;
    vllm-offloading    vLLM's OffloadingConnector, host memory  } written, not yet
                                                                  run (no GPU here)
    NAME+mp            any kvtier configuration in vLLM's default multiprocess
                       mode (the others run scheduler and worker in one process,
                       VLLM_ENABLE_V1_MULTIPROCESSING=0); the report compares
                       each with its single-process run
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench import workloads as wl
from kvtier.bench.tinymodels import has_cuda, resolve_dtype

CONFIGS = ("recompute", "prefix-cache", "kvtier-memory", "kvtier-disk", "kvtier-shared", "example")
W3_CONFIGS = ("recompute", "kvtier-local-disk", "kvtier-shared")
W0_CONFIGS = ("prefix-cache", "kvtier-shared")
SWEEP_CONFIGS = ("recompute", "prefix-cache", "kvtier-shared", "kvtier-local-drive")
# Configurations without a connector: nothing of a sweep's warm phase can
# serve their bursts (the engine's cache is emptied before each), so they skip it.
NO_CONNECTOR = ("recompute", "prefix-cache")
# The shared tier's other read paths (FileTierConfig o_direct / aio).
READ_PATHS = {
    "kvtier-shared-buffered": {"o_direct": False},
    "kvtier-shared-direct": {"o_direct": True, "aio": False, "adaptive_reads": False},
    "kvtier-shared-aio": {"o_direct": True, "aio": True, "adaptive_reads": False},
    "kvtier-shared-4k": {},
    "kvtier-shared-w6": {"read_window_bytes": "6MiB"},
    "kvtier-shared-w16": {"read_window_bytes": "16MiB"},
    "kvtier-shared-w32": {"read_window_bytes": "32MiB"},
    "kvtier-shared-w128": {"read_window_bytes": "128MiB"},
}
# Store options of the configurations that differ from the default in more
# than their tier (the read buffers' pages), and the connector's.
STORE_OPTIONS = {"kvtier-shared-4k": {"huge_pages": False}}
LOAD_ORDERS = {"kvtier-shared-pairs": {"load_threads": 2}, "kvtier-shared-fair": {"load_threads": 64}}
ALL_CONFIGS = (CONFIGS + ("kvtier-local-disk", "kvtier-local-drive", "kvtier-staged", "kvtier-throttled")
               + tuple(READ_PATHS) + tuple(LOAD_ORDERS))
BLOCK = 128
CHUNK = 256

# Peers that need CUDA. On a CUDA host ``--configs`` may name them; elsewhere
# they are reported with the reason, never silently dropped.
CUDA_PEERS = {
    "lmcache": "LMCache 0.5.6 installs, but its vLLM connector has no CPU path ('No supported cpu connector found')",
    "vllm-offloading": "vLLM's OffloadingConnector and SimpleCPUOffloadConnector refuse the CPU platform",
}
ALL_CONFIGS = ALL_CONFIGS + tuple(CUDA_PEERS)
MP = "+mp"  # suffix: the same configuration in vLLM's default multiprocess mode


def base_config(name: str) -> str:
    return name.removesuffix(MP)


def valid_config(name: str) -> bool:
    base = base_config(name)
    return base in ALL_CONFIGS and (base == name or base.startswith("kvtier"))


def unavailable_peers() -> dict[str, str]:
    return {} if has_cuda() else dict(CUDA_PEERS)


@dataclass(frozen=True)
class ResumeConfig:
    workdir: Path
    workload: str = "w1"
    model: str = "qwen2.5-0.5b"
    contexts: tuple[int, ...] = (2048, 8192)
    sessions: int = 3
    resumes: int = 1                       # W1/W3: cold resumes of every session (phases resume, resume-2, ...)
    configs: tuple[str, ...] = ()          # empty: the workload's default set
    dummy_weights: bool = True
    dtype: str = "auto"                    # dummy weights: bfloat16 where the host computes it natively, else float32
    seed: int = 0
    chat: wl.ChatShape = field(default_factory=wl.ChatShape)
    instances: int = 3
    repeats: int = 3                       # W0: alternating rounds per configuration
    rounds: int = 1                        # W1-W3: engine runs per configuration, in ABBA order
    warmup: bool = False                   # one unmeasured engine run before the measured ones
    fio: bool = True
    vocab: int | None = None               # token ids drawn below this (default: the model preset's)
    engine_timeout_s: float = 3600
    throttle_bps: float = 1e6              # kvtier-throttled: the mount's read rate, bytes per second
    load_decision: str = "auto"            # the connector's load_decision (docs/vllm.md)
    concurrency: tuple[int, ...] = ()      # W1: sessions returning at once, one burst per level (a sweep)
    answer_tokens: int = 16                # sweep: tokens each resumed session answers
    local_ratio: float = 6.78 / 10.3       # sweep: kvtier-local-drive's read rate over the device's
    tensor_parallel: int = 1               # the engines' tensor_parallel_size (a CPU each)
    staging_bytes: int = 32 << 20          # kvtier-staged: its memory tier's capacity
    device_bps: float = 0                  # sweep: model the device at this read rate (0: as it is)
    rates: tuple[float, ...] = ()          # W2: arrival rates, one phase each, ascending (goodput.py)
    slo_s: float = 2.0                     # W2 over rates: the TTFT p95 target, seconds

    @property
    def sweep(self) -> bool:
        return self.workload == "w1" and bool(self.concurrency)

    @property
    def goodput(self) -> bool:
        return self.workload == "w2" and bool(self.rates)

    def config_names(self) -> tuple[str, ...]:
        if self.configs:
            return self.configs
        default = {"w3": W3_CONFIGS, "w0": W0_CONFIGS}.get(self.workload, CONFIGS)
        if self.sweep:
            return SWEEP_CONFIGS
        if self.goodput:
            from kvtier.bench.goodput import CONFIGS as GOODPUT_CONFIGS

            return GOODPUT_CONFIGS
        # Where they run (CUDA), the peers join W1 and W2.
        return default + (tuple(CUDA_PEERS) if self.workload in ("w1", "w2") and has_cuda() else ())


def longest_request(workload: wl.Workload) -> int:
    return max(len(r.tokens) + r.max_tokens for p in workload.phases for r in p.requests)


def engine_args(cfg: ResumeConfig, workload: wl.Workload, name: str) -> dict:
    longest = longest_request(workload)
    per_request = -(-(longest + 8) // BLOCK)
    concurrency = max(p.concurrency for p in workload.for_instance(0).phases)
    engine = {
        "max_model_len": -(-(longest + 1) // BLOCK) * BLOCK + BLOCK,
        # A whole prompt prefills in one step: ExampleConnector saves only the
        # first step's share of a chunked prefill and then fails its own load
        # (shape mismatch); one setting for every configuration keeps them alike.
        "max_num_batched_tokens": max(4096, -(-(longest + 1) // BLOCK) * BLOCK + BLOCK),
        # Room for what runs at once and a spare block (plus vLLM's null
        # block): the next session evicts the previous ones, so a resume
        # misses in vLLM and only a connector can serve it.
        "num_gpu_blocks_override": concurrency * per_request + 2,
        "kv_cache_memory_bytes": 4 << 30,
        "enable_prefix_caching": name != "recompute",
    }
    if cfg.tensor_parallel > 1:
        engine["tensor_parallel_size"] = cfg.tensor_parallel
    if cfg.dummy_weights:
        engine.update(load_format="dummy", dtype=resolve_dtype(cfg.dtype))
    return engine


def engine_spec(cfg: ResumeConfig, name: str, label: str, workload: wl.Workload, model_dir: Path,
                instance: int, barrier: Path | None, node_memory: str = "") -> dict:
    """What engine process ``instance`` of configuration ``name`` runs
    (``kvtier.bench.vllm_runner`` reads it): model, engine arguments, the
    kvtier store or peer connector, and what each cold phase drops."""
    store = cfg.workdir / "stores" / f"{cfg.workload}-{name}-{label}"
    name = base_config(name)
    engine = engine_args(cfg, workload, name)
    tiers = {
        "kvtier-memory": [{"kind": "memory", "capacity": "8GiB"}],
        "kvtier-disk": [{"kind": "disk", "path": str(store), "capacity": "32GiB"}],
        "kvtier-local-disk": [{"kind": "disk", "path": str(store / f"instance-{instance}"), "capacity": "32GiB"}],
        "kvtier-local-drive": [{"kind": "disk", "path": str(store), "capacity": "32GiB"}],
        "kvtier-staged": [{"kind": "memory", "capacity": f"{cfg.staging_bytes}B"},
                          {"kind": "shared", "path": str(store), "capacity": "32GiB"}],
        "kvtier-shared": [{"kind": "shared", "path": str(store), "capacity": "32GiB"}],
        "kvtier-throttled": [{"kind": "shared", "path": str(store), "capacity": "32GiB"}],
        **{n: [{"kind": "shared", "path": str(store), "capacity": "32GiB", **opts}] for n, opts in READ_PATHS.items()},
        **{n: [{"kind": "shared", "path": str(store), "capacity": "32GiB"}] for n in LOAD_ORDERS},
    }
    kvtier = ({"chunk_tokens": CHUNK, "tiers": tiers[name], "load_decision": cfg.load_decision}
              if name in tiers else None)
    if kvtier is not None:
        kvtier.update(STORE_OPTIONS.get(name, {}))
        kvtier.update(LOAD_ORDERS.get(name, {}))
    if kvtier is not None and node_memory:
        kvtier["node_memory_dir"] = node_memory  # this run's node memory, shared by its instances
    cold: dict = {}
    if name in ("kvtier-shared", "kvtier-local-disk", "kvtier-local-drive", *READ_PATHS, *LOAD_ORDERS):
        cold = {"drop_page_cache": True}
    if name == "kvtier-staged":
        cold = {"drop_page_cache": True, "drop_tiers": ["memory"]}
    if name == "vllm-offloading":
        # vLLM's own CPU offloading (CUDA hosts): host memory as the second tier.
        engine["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 30},
        }
    if name == "lmcache":
        # LMCache's vLLM connector (CUDA hosts), local CPU backend; its
        # settings come from LMCACHE_* variables (set where resume.py starts the engine).
        engine["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if name == "example":
        engine["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
        cold = {"drop_page_cache_dirs": [str(store)]}
    part = workload.for_instance(instance) if workload.instances > 1 else workload
    return {"model": str(model_dir), "kvtier": kvtier, "engine": engine, "workload": part.to_json(),
            "block_tokens": BLOCK, "cold": cold, "instance": instance,
            "barrier": str(barrier) if barrier else None}
