"""What both storage benchmarks share (``storage``: a directory against fio;
``storage_remote``: a network tier against its server's own ceiling): the
configuration, the data set (sessions of prefix-chained chunk keys), writing
it, timing and CPU-accounting session loads (``LoadPass``, which the network
tiers' ceilings in ``ceiling`` return too), summarizing repeated passes, and
the memory-tier comparison.

Neither benchmark imports the other's private names: both import from here.
"""

from __future__ import annotations

import math
import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvtier.buffers import LoadBuffers, copy_into
from kvtier.auth import Keyring
from kvtier.codec import ChunkObject, encode, payload_checksum, seal
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.bench.fio import FioRead
from kvtier.bench.readtrace import BEGIN, END, ReadTrace
from kvtier.bench.models import ModelShape
from kvtier.progress import Progress
from kvtier.tiers.memory import MemoryConfig

MiB = 1 << 20
GiB = 1 << 30

# Measured by default: the file tiers' default read path, O_DIRECT through
# native AIO (the native read loop where it was built), loading into
# buffers the store lends ("direct-aio-lent": read and verified in place, no
# copy), taken object by object through ``TieredStore.fetch`` as vLLM's
# worker takes them ("direct-aio-fetch": the engine's path, in the tier's
# own buffers, no copy) and into the caller's own buffers ("direct-aio":
# copied into them), and buffered reads ("buffered", o_direct: false, into
# the caller's own). ``--read-modes`` also takes "direct" (O_DIRECT
# with one pool thread per blocking read, aio: false), "direct-aio-4k" (the
# default path with its read buffers on 4 KiB pages, the store's
# huge_pages: false), "direct-aio-lent-python" (as "direct-aio-lent", read
# by the Python AIO driver instead of the native read loop, native_reads:
# false: the two drivers side by side in one run) and "auto" (adaptive
# reads: each load by whichever of the two paths read faster lately).
# "direct-aio-lent-auth" and "direct-aio-fetch-auth" are those two modes
# with a cluster key (auth_key_file): every object's seal checked as well
# (kvtier/auth.py), beside the same modes without one.
READ_MODES = ("direct-aio-lent", "direct-aio-fetch", "direct-aio", "buffered")
AUTH_SUFFIX = "-auth"
AUTH_MODES = ("direct-aio-lent-auth", "direct-aio-fetch-auth")
READ_MODE_CHOICES = ("auto", "direct", "buffered", "direct-aio", "direct-aio-lent", "direct-aio-lent-python",
                     "direct-aio-4k", "direct-aio-fetch", *AUTH_MODES)
LENT_MODES = ("direct-aio-lent", "direct-aio-lent-python", "direct-aio-lent-auth")  # into ``TieredStore.load_buffers``
# Loads through ``TieredStore.fetch``: each verified object handed over in
# the tier's own buffer, one at a time, as vLLM's worker takes them
# (integrations/vllm/worker.py); the engine's copy out of it is the engine's.
FETCH_MODES = ("direct-aio-fetch", "direct-aio-fetch-auth")
NO_COPY_MODES = LENT_MODES + FETCH_MODES  # read and verified in place: kvtier copies nothing


def fio_mode(mode: str) -> str:
    """The fio read mode a kvtier read mode compares with."""
    return "buffered" if mode == "buffered" else "direct"


class StorageBenchError(RuntimeError):
    """The benchmark could not run: storage trouble or missing data (the
    message says which; the tier's log lines say why)."""


# Read windows tried by default: on a directory, from two objects of the
# default chunk up to the tiers' default (a window's CPU per GB differs at
# one rate: docs/benchmarks.md); on a network tier, from 16 MiB up to it.
DIR_WINDOWS = (6 * MiB, 16 * MiB, 32 * MiB, 128 * MiB)
TIER_WINDOWS = (16 * MiB, 32 * MiB, 128 * MiB)


@dataclass(frozen=True)
class StorageBenchConfig:
    directory: Path | None = None  # a directory to measure (fio + the shared tier) ...
    tier: str | None = None  # ... or a network tier URL (redis://, s3://): see storage_remote
    size_bytes: int = 2 * GiB
    model: ModelShape = field(default_factory=lambda: ModelShape("qwen2.5-0.5b", 24, 2, 64))
    chunk_tokens: int = 256
    session_chunks: int = 32
    windows: tuple[int, ...] = DIR_WINDOWS
    fio_depths: tuple[int, ...] = (1, 8, 32)
    read_modes: tuple[str, ...] = READ_MODES
    repeats: int = 3
    memory_bytes: int = 1 * GiB
    io_threads: int = 32
    ceiling: bool = True  # network tiers: measure the server's own ceiling (redis-benchmark, plain GETs)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs`` (nearest rank), NaN for none."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def host() -> dict:
    """The machine a result was measured on, for the report."""
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, every thread
    included (kvtier's reads run on its tiers' pool threads)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def namespace(cfg: StorageBenchConfig) -> Namespace:
    return Namespace(
        model=f"bench/{cfg.model.name}", model_fingerprint="storage-bench", kv_dtype=cfg.model.dtype,
        layout="kvtier:LKHTD", num_layers=cfg.model.num_layers, num_kv_heads=cfg.model.num_kv_heads,
        head_dim=cfg.model.head_dim, chunk_tokens=cfg.chunk_tokens,
    )


def sessions(cfg: StorageBenchConfig, ns: Namespace) -> list[list[ChunkKey]]:
    """``size_bytes`` of chunks cut into sessions of ``session_chunks``, each
    session a prefix chain of its own."""
    chunk_bytes = cfg.model.bytes_per_token * cfg.chunk_tokens
    n_chunks = max(1, math.ceil(cfg.size_bytes / chunk_bytes))
    n_sessions = math.ceil(n_chunks / cfg.session_chunks)
    nsd = ns.digest()
    out = []
    for s in range(n_sessions):
        chunks = min(cfg.session_chunks, n_chunks - s * cfg.session_chunks)
        tokens = [(s * 7919 + i * 31) % 150_000 for i in range(chunks * cfg.chunk_tokens)]
        out.append(chunk_keys(ns, tokens, ns_digest=nsd))
    return out


def populate(tier, sessions: list[list[ChunkKey]], cfg: StorageBenchConfig, progress: Progress, where: str,
             keyring: Keyring | None = None) -> int:
    """Write every chunk through ``tier.store_async`` (skipping those already
    there), sealed with ``keyring`` if given, as a store with a key file
    writes them. Returns object bytes. ``where`` names the storage in errors."""
    base = os.urandom(cfg.model.bytes_per_token * cfg.chunk_tokens)
    shape = cfg.model.chunk_shape(cfg.chunk_tokens)
    tick = progress("write chunks", sum(len(s) for s in sessions))
    total = 0
    pending = []
    for s, keys in enumerate(sessions):
        objs: list[ChunkObject] = []
        for i, k in enumerate(keys):
            payload = bytearray(base)
            payload[:16] = s.to_bytes(8, "little") + i.to_bytes(8, "little")
            objs.append(encode(k, cfg.model.dtype, shape, payload))
            if keyring is not None:
                seal(objs[-1], keyring)
            total += objs[-1].nbytes
        pending.append((tier.store_async(objs), len(objs)))
        while len(pending) > 2:  # bound memory: at most a few sessions in flight
            f, n = pending.pop(0)
            if f.result() != n:
                raise StorageBenchError(f"could not write benchmark data to {where} (full, or unreachable? see the log)")
            tick(n)
    for f, n in pending:
        if f.result() != n:
            raise StorageBenchError(f"could not write benchmark data to {where} (full, or unreachable? see the log)")
        tick(n)
    return total


@dataclass(frozen=True)
class LoadPass:
    """One timed pass of reads (kvtier's session loads, or a ceiling's plain
    GETs): payload bytes delivered, wall seconds, and the reading client's CPU
    seconds (user + system, all threads) spent meanwhile."""

    nbytes: int
    seconds: float
    cpu_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / 1e9)


def summarize(passes: Sequence[LoadPass | FioRead]) -> dict:
    """Repeated runs of one measurement (kvtier's loads, a ceiling client's
    GETs, a fio job) as the reports give them: every run's rate and CPU cost,
    and their medians."""
    return {
        "runs_gbps": [p.gbps for p in passes],
        "median_gbps": median([p.gbps for p in passes]),
        "runs_cpu_s_per_gb": [p.cpu_s_per_gb for p in passes],
        "cpu_s_per_gb": median([p.cpu_s_per_gb for p in passes]),
    }


def load_sessions(store: TieredStore, sessions, bufs, per_load: list[float], tick, what: str, where: str,
                  trace: ReadTrace | None = None) -> LoadPass:
    """Load every session once through ``store``, as an engine would; append
    each load's seconds to ``per_load``; mark each load in ``trace``.
    ``bufs``: the caller's own buffers or lent ones (``TieredStore.load``),
    or None: each object taken from ``TieredStore.fetch`` as it is handed
    over, and given back (``FETCH_MODES``)."""
    nbytes = 0
    c0, t0 = cpu_seconds(), time.perf_counter()
    for keys in sessions:
        s0 = time.perf_counter()
        if trace is not None:
            trace.mark(BEGIN)
        if bufs is None:
            n = got = 0
            for obj in store.fetch(keys):  # the store takes each object back when the next is asked for
                n += 1
                got += obj.header.payload_len
        else:
            n = store.load(keys, bufs[: len(keys)])
            got = n * (bufs.payload_bytes if isinstance(bufs, LoadBuffers) else bufs[0].nbytes)
        if trace is not None:
            trace.mark(END)
        per_load.append(time.perf_counter() - s0)
        if n != len(keys):
            raise StorageBenchError(f"{what} served {n} of {len(keys)} chunks: storage trouble, {where}")
        nbytes += got
        tick(1)
    return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)


def memory_bench(cfg: StorageBenchConfig, sessions, lower: TierSpec, bufs, progress: Progress) -> dict:
    """Memory-tier loads (promoted from ``lower``, which holds the data)
    against a plain memcpy of the same bytes."""
    budget = min(cfg.memory_bytes, cfg.size_bytes)
    mem_spec = TierSpec("memory", MemoryConfig(capacity=budget + 64 * MiB))
    store = TieredStore(StoreConfig(tiers=(mem_spec, lower), promote=True))
    try:
        picked, used = [], 0
        for keys in sessions:
            size = sum(k.num_tokens for k in keys) * cfg.model.bytes_per_token
            if used + size > budget:
                break
            if store.load(keys, bufs[: len(keys)]) != len(keys):  # promotes into memory
                raise StorageBenchError("could not read benchmark data back")
            picked.append(keys)
            used += size
        if not picked:
            per = sum(k.num_tokens for k in sessions[0]) * cfg.model.bytes_per_token
            raise StorageBenchError(f"--memory {budget // MiB} MiB holds no whole session ({per / MiB:.0f} MiB): "
                                    f"raise --memory or lower --session-chunks")
        mem = store.tier("memory")
        if any(mem.lookup(k) != len(k) for k in picked):
            raise StorageBenchError("memory tier did not keep the benchmark data")
        sources = [[o.payload for o in mem.fetch(k)] for k in picked]
        mem_runs, cpy_runs, cpy_cpu, sum_cpu = [], [], [], []
        tick = progress("memory loads", cfg.repeats * 2)
        for _ in range(max(cfg.repeats, 5)):
            c0, t0 = cpu_seconds(), time.perf_counter()
            for srcs in sources:
                for src, dst in zip(srcs, bufs):
                    copy_into(dst, src)
            cpy_runs.append(used / (time.perf_counter() - t0) / 1e9)
            cpy_cpu.append((cpu_seconds() - c0) / (used / 1e9))
            # What verifying the same bytes costs (every load checks each payload's XXH3-128).
            c0 = cpu_seconds()
            for srcs in sources:
                for src in srcs:
                    payload_checksum(src)
            sum_cpu.append((cpu_seconds() - c0) / (used / 1e9))
            t0 = time.perf_counter()
            for keys in picked:
                if store.load(keys, bufs[: len(keys)]) != len(keys):
                    raise StorageBenchError("memory tier lost data during the benchmark")
            mem_runs.append(used / (time.perf_counter() - t0) / 1e9)
            tick(2)
    finally:
        store.close()
    return {
        "memory_bench_bytes": used,
        "memcpy_runs_gbps": cpy_runs,
        "memory_runs_gbps": mem_runs,
        "memcpy_gbps": median(cpy_runs),
        "memory_load_gbps": median(mem_runs),
        "copy_cpu_s_per_gb": median(cpy_cpu),
        "checksum_cpu_s_per_gb": median(sum_cpu),
    }
