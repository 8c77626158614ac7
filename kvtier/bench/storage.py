"""``kvtier bench storage``: how close kvtier's reads get to the storage limit.

On a network tier (``--tier redis://...``, ``s3://...``) see ``storage_remote``.
In one run, on one directory:
1. write ``size`` bytes of chunk objects shaped like a real model's KV
   (sessions of ``session_chunks`` chunks, prefix-chained keys);
2. fio sequential reads: O_DIRECT at several queue depths, and buffered
   128 KiB reads with the kernel's readahead in up to 16 streams (one file
   each, laid out and synced first, page cache dropped); the
   best of them is the storage limit;
3. kvtier cold loads (page cache dropped, parallel within a byte window) at
   several window sizes and in both read modes (O_DIRECT and buffered), through
   ``TieredStore.load`` as an engine would call it (lookup, verified reads,
   copy into caller buffers);
4. kvtier memory-tier loads against a plain memcpy of the same bytes.

Every figure is the median of ``repeats`` runs; ratios compare medians of the
same run. Nothing is cached between runs of step 3 (the files are dropped
from the page cache before each).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvtier.buffers import alloc, copy_into
from kvtier.codec import ChunkObject, encode
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.bench.fio import BUFFERED_STREAMS, fio_seq_read, remove_fio_file
from kvtier.bench.models import ModelShape
from kvtier.tiers.memory import MemoryConfig
from kvtier.tiers.shared import SharedConfig, SharedTier
from kvtier.version import __version__

MiB = 1 << 20
GiB = 1 << 30


class StorageBenchError(RuntimeError):
    """The benchmark could not run: storage trouble or missing data (the
    message says which; the tier's log lines say why)."""


READ_MODES = ("direct", "buffered")  # the file tiers' o_direct: true / false


@dataclass(frozen=True)
class StorageBenchConfig:
    directory: Path | None = None  # a directory to measure (fio + the shared tier) ...
    tier: str | None = None  # ... or a network tier URL (redis://, s3://): see storage_remote
    size_bytes: int = 2 * GiB
    model: ModelShape = field(default_factory=lambda: ModelShape("qwen2.5-0.5b", 24, 2, 64))
    chunk_tokens: int = 256
    session_chunks: int = 32
    windows: tuple[int, ...] = (16 * MiB, 64 * MiB, 128 * MiB)
    fio_depths: tuple[int, ...] = (1, 8, 32)
    read_modes: tuple[str, ...] = READ_MODES
    repeats: int = 3
    memory_bytes: int = 1 * GiB
    io_threads: int = 32


Progress = Callable[[str, int], Callable[[int], None]]


def _no_progress(desc: str, total: int) -> Callable[[int], None]:
    return lambda n: None


def _sessions(cfg: StorageBenchConfig, ns: Namespace) -> list[list[ChunkKey]]:
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


def _populate(tier, sessions: list[list[ChunkKey]], cfg: StorageBenchConfig, progress: Progress, where: str) -> int:
    """Write every chunk through ``tier.store_async`` (skipping those already
    there). Returns object bytes. ``where`` names the storage in errors."""
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


def _shared_spec(path: Path, capacity: int, window: int, threads: int, mode: str = "direct") -> TierSpec:
    return TierSpec(
        "shared",
        SharedConfig(
            path=str(path), capacity=capacity, name="shared", o_direct=mode == "direct",
            read_window_bytes=window, io_threads=threads, gc_interval_s=0,
        ),
    )


def load_sessions(store: TieredStore, sessions, bufs, per_load: list[float], tick, what: str, where: str) -> float:
    """Load every session once through ``store``, as an engine would; append
    each load's seconds to ``per_load``; return GB/s over the whole pass."""
    nbytes, t0 = 0, time.perf_counter()
    for keys in sessions:
        s0 = time.perf_counter()
        n = store.load(keys, bufs[: len(keys)])
        per_load.append(time.perf_counter() - s0)
        if n != len(keys):
            raise StorageBenchError(f"{what} served {n} of {len(keys)} chunks: storage trouble, {where}")
        nbytes += sum(bufs[i].nbytes for i in range(n))
        tick(1)
    return nbytes / (time.perf_counter() - t0) / 1e9


def cold_label(window: int, mode: str) -> str:
    """The key of one cold-load variant in the results: "64MiB" (O_DIRECT)
    or "64MiB buffered"."""
    return f"{window // MiB}MiB" + ("" if mode == "direct" else f" {mode}")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _namespace(cfg: StorageBenchConfig) -> Namespace:
    return Namespace(
        model=f"bench/{cfg.model.name}", model_fingerprint="storage-bench", kv_dtype=cfg.model.dtype,
        layout="kvtier:LKHTD", num_layers=cfg.model.num_layers, num_kv_heads=cfg.model.num_kv_heads,
        head_dim=cfg.model.head_dim, chunk_tokens=cfg.chunk_tokens,
    )


def run(cfg: StorageBenchConfig, progress: Progress = _no_progress, log: Callable[[str], None] = print) -> dict:
    if cfg.tier is not None:
        from kvtier.bench import storage_remote

        return storage_remote.run(cfg, progress)
    root = Path(cfg.directory)
    store_dir, fio_dir = root / "store", root / "fio"
    sessions = _sessions(cfg, _namespace(cfg))
    n_chunks = sum(len(s) for s in sessions)
    capacity = 4 * cfg.size_bytes + GiB
    result: dict = {
        "kvtier_version": __version__,
        "directory": str(root.resolve()),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "model": asdict(cfg.model),
        "chunk_tokens": cfg.chunk_tokens,
        "chunk_bytes": cfg.model.bytes_per_token * cfg.chunk_tokens,
        "chunks": n_chunks,
        "sessions": len(sessions),
        "repeats": cfg.repeats,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    # 1. data
    t_start = t0 = time.perf_counter()
    writer_cfg = _shared_spec(store_dir, capacity, 64 * MiB, cfg.io_threads).config
    with SharedTier(writer_cfg) as writer:
        total_bytes = _populate(writer, sessions, cfg, progress, str(writer.dir.root))
        writer.drop_cache()
    result["data_bytes"] = total_bytes
    result["filesystem"] = _fs_type(store_dir)
    result["write_seconds"] = time.perf_counter() - t0

    # 2+3. fio and kvtier cold loads, interleaved repeat by repeat so that
    # both see the same device conditions (shared and virtual disks drift).
    fio_size = min(cfg.size_bytes, 2 * GiB)
    bufs = [alloc(cfg.model.bytes_per_token * cfg.chunk_tokens) for _ in range(cfg.session_chunks)]
    # fio: O_DIRECT at each depth, and buffered 128 KiB reads (readahead) in
    # as many streams as kvtier reads objects at once (its I/O threads).
    streams = min(cfg.io_threads, BUFFERED_STREAMS)
    fio_jobs = {f"qd{d}": (d, "1M", True, 1) for d in cfg.fio_depths}
    if "buffered" in cfg.read_modes:
        fio_jobs["buffered-128k"] = (1, "128k", False, streams)
    fio_runs: dict[str, list[float]] = {j: [] for j in fio_jobs}
    variants = [(w, m) for m in cfg.read_modes for w in cfg.windows]
    cold_runs: dict[tuple, list[float]] = {v: [] for v in variants}
    per_load: dict[tuple, list[float]] = {v: [] for v in variants}
    stores = {
        (w, m): TieredStore(StoreConfig(tiers=(_shared_spec(store_dir, capacity, w, cfg.io_threads, m),), promote=False))
        for w, m in variants
    }
    tick = progress("fio + cold loads", cfg.repeats * (len(fio_jobs) + len(variants) * len(sessions)))
    try:
        for _ in range(cfg.repeats):
            for job, (depth, block, o_direct, streams) in fio_jobs.items():
                fio_runs[job].append(fio_seq_read(fio_dir, depth, fio_size, block=block, direct=o_direct, jobs=streams))
                tick(1)
            for variant, store in stores.items():
                store.tier("shared").drop_cache()
                cold_runs[variant].append(load_sessions(store, sessions, bufs, per_load[variant], tick, "cold load", "see the log"))
        direct = {v: s.tier("shared").dir.direct_ok and v[1] == "direct" for v, s in stores.items()}
    finally:
        remove_fio_file(fio_dir)
        for st in stores.values():
            st.close()
    result["fio"] = {j: {"runs_gbps": r, "median_gbps": _median(r)} for j, r in fio_runs.items()}
    result["fio_streams"] = streams
    result["fio_best_gbps"] = max(v["median_gbps"] for v in result["fio"].values())
    cold = {
        cold_label(w, m): {
            "window_bytes": w,
            "read_mode": m,
            "runs_gbps": cold_runs[w, m],
            "median_gbps": _median(cold_runs[w, m]),
            "session_load_p50_s": _median(per_load[w, m]),
            "o_direct": direct[w, m],
        }
        for w, m in variants
    }
    result["cold"] = cold
    best = max(cold, key=lambda w: cold[w]["median_gbps"])
    result["cold_best_window"] = best
    result["cold_load_gbps"] = cold[best]["median_gbps"]
    result["cold_vs_fio"] = result["cold_load_gbps"] / result["fio_best_gbps"]

    # 4. memory tier vs memcpy of the same bytes
    lower = _shared_spec(store_dir, capacity, 64 * MiB, cfg.io_threads)
    result.update(_memory_bench(cfg, sessions, lower, bufs, progress))
    result["memory_vs_memcpy"] = result["memory_load_gbps"] / result["memcpy_gbps"]
    result["seconds"] = time.perf_counter() - t_start
    return result


def _memory_bench(cfg, sessions, lower: TierSpec, bufs, progress) -> dict:
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
        mem_runs, cpy_runs = [], []
        tick = progress("memory loads", cfg.repeats * 2)
        for _ in range(max(cfg.repeats, 5)):
            t0 = time.perf_counter()
            for srcs in sources:
                for src, dst in zip(srcs, bufs):
                    copy_into(dst, src)
            cpy_runs.append(used / (time.perf_counter() - t0) / 1e9)
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
        "memcpy_gbps": _median(cpy_runs),
        "memory_load_gbps": _median(mem_runs),
    }


def _fs_type(path: Path) -> str:
    """File system type and device of the mount holding ``path`` (/proc/mounts)."""
    target = os.path.realpath(path)
    best = ("", "unknown", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}" if best[2] else best[1]


def format_table(r: dict) -> str:
    if "tier" in r:
        from kvtier.bench import storage_remote

        return storage_remote.format_table(r)
    fio_best = r["fio_best_gbps"]
    lines = [
        f"kvtier bench storage  {r['directory']} ({r['filesystem']})",
        f"data: {r['data_bytes'] / GiB:.2f} GiB in {r['chunks']} chunks of {r['chunk_bytes'] / MiB:.2f} MiB "
        f"({r['model']['name']}, {r['chunk_tokens']} tokens/chunk, {r['sessions']} sessions); "
        f"medians of {r['repeats']} runs",
        "",
        f"{'measurement':<40}{'GB/s':>8}  {'ratio':>18}",
        "-" * 68,
    ]
    for job, v in r["fio"].items():
        what = (f"fio seq read buffered 128KiB x{r.get('fio_streams', 1)}" if job.startswith("buffered")
                else "fio seq read O_DIRECT 1MiB " + job)
        lines.append(f"{what:<40}{v['median_gbps']:>8.2f}  {v['median_gbps'] / fio_best:>12.2f} x fio")
    for w, v in r["cold"].items():
        mark = " *" if w == r["cold_best_window"] else ""
        lines.append(f"{'kvtier cold load, window ' + w:<40}{v['median_gbps']:>8.2f}  {v['median_gbps'] / fio_best:>12.2f} x fio{mark}")
    lines.append(f"{'memcpy (same bytes)':<40}{r['memcpy_gbps']:>8.2f}")
    lines.append(
        f"{'kvtier memory-tier load':<40}{r['memory_load_gbps']:>8.2f}  {r['memory_vs_memcpy']:>9.2f} x memcpy"
    )
    lines.append("")
    lines.append(
        f"cold load (best window {r['cold_best_window']}) = {r['cold_vs_fio']:.2f} x best fio; "
        f"memory load = {r['memory_vs_memcpy']:.2f} x memcpy"
    )
    return "\n".join(lines)
