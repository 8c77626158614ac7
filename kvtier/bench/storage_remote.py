"""``kvtier bench storage --tier URL``: the storage benchmark on a network tier
(Redis/Valkey, S3), where fio has nothing to measure.

In one run, on one tier (a URL as in the config, e.g. ``redis://host:6379``,
``s3://bucket/prefix?endpoint=http://host:8333``):
1. write ``size`` bytes of chunk objects shaped like a real model's KV, as
   write-through would (sessions of ``session_chunks`` chunks, batched);
2. single-chunk loads, one at a time: the latency one chunk costs without
   contention (p50/p99 over every chunk);
3. session loads through ``TieredStore.load`` at several read windows:
   throughput, the time of one session's load, and the latency of each chunk
   read under that window's concurrency (p50/p99);
4. memory-tier loads (promoted from the tier) against memcpy, as with ``--dir``.

fio is skipped, and said so in the report: it measures block devices and
file systems. Server-side caches cannot be dropped from here: Redis serves
from memory anyway; an S3 server may serve from its own page cache.

The data is kept for reruns (a rerun skips existing objects). It is written
under its own namespace; Redis gets the key prefix ``kvtier-bench:v1:`` unless
the URL names one (kvtier's capacity budget is per prefix, so the benchmark
never evicts another prefix's objects), and S3 runs no collection pass: give
the benchmark a prefix or database of its own.
"""

from __future__ import annotations

import math
import os
import platform
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench.storage import (
    GiB,
    MiB,
    Progress,
    StorageBenchConfig,
    StorageBenchError,
    _median,
    _memory_bench,
    _namespace,
    _no_progress,
    _populate,
    load_sessions,
    _sessions,
)
from kvtier.buffers import alloc
from kvtier.config import ConfigError, StoreConfig, TierSpec, parse_tier, parse_tier_url
from kvtier.engine.store import TieredStore
from kvtier.tiers import registry
from kvtier.version import __version__

KINDS = ("redis", "s3")
# URL options never echoed into reports or logs.
_SECRET_OPTIONS = ("password", "secret_access_key", "access_key_id", "username")


def tier_spec(url: str, cfg: StorageBenchConfig, window: int) -> TierSpec:
    """The tier of ``url`` with the benchmark's window, threads and (unless
    the URL sets it) capacity; raises ConfigError naming ``--tier``."""
    values: dict[str, Any] = parse_tier_url(url, "--tier")
    kind = values["kind"]
    if kind not in KINDS:
        raise ConfigError("--tier", f"{kind}:// is not a network tier", "use --dir for directories; --tier takes redis:// or s3://")
    values.setdefault("capacity", 4 * cfg.size_bytes + GiB)
    values["read_window_bytes"] = window
    values["io_threads"] = cfg.io_threads
    values.setdefault("name", kind)
    if kind == "redis":
        values.setdefault("key_prefix", "kvtier-bench:v1:")
        values.setdefault("pool_size", cfg.io_threads + 4)
    else:
        values.setdefault("gc_interval_s", 0)  # the benchmark's data is never collected mid-run
    return parse_tier(values, "--tier")


def redact(url: str) -> str:
    """``url`` with credential options blanked (reports and logs)."""
    parts = urlsplit(url)
    query = "&".join(
        f"{k}=***" if k in _SECRET_OPTIONS else f"{k}={v}"
        for k, _, v in (p.partition("=") for p in parts.query.split("&") if p)
    )
    return f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")


def _open(spec: TierSpec):
    return registry.resolve(spec.kind)(spec.config)


class _ReadTimer:
    """Records the duration of every object read of a tier instance: wraps
    the ``_read_one`` its fetches run on the pool (``PooledIO``). The real
    read runs; only a clock is added around it."""

    def __init__(self, tier):
        self.times: list[float] = []
        self._lock = threading.Lock()
        inner = tier._read_one

        def timed(key):
            t0 = time.perf_counter()
            try:
                return inner(key)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.times.append(dt)

        tier._read_one = timed

    def take(self) -> list[float]:
        with self._lock:
            out, self.times = self.times, []
        return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def run(cfg: StorageBenchConfig, progress: Progress = _no_progress) -> dict:
    url = cfg.tier
    assert url is not None
    first = tier_spec(url, cfg, cfg.windows[0])
    sessions = _sessions(cfg, _namespace(cfg))
    chunk_bytes = cfg.model.bytes_per_token * cfg.chunk_tokens
    result: dict = {
        "kvtier_version": __version__,
        "tier": redact(url),
        "kind": first.kind,
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "model": {"name": cfg.model.name, "bytes_per_token": cfg.model.bytes_per_token},
        "chunk_tokens": cfg.chunk_tokens,
        "chunk_bytes": chunk_bytes,
        "chunks": sum(len(s) for s in sessions),
        "sessions": len(sessions),
        "repeats": cfg.repeats,
        "io_threads": cfg.io_threads,
        "fio": None,
        "fio_skipped": f"fio measures block devices and file systems; the {first.kind} tier is a network service",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    # 1. data
    t_start = t0 = time.perf_counter()
    writer = _open(first)
    try:
        result["data_bytes"] = _populate(writer, sessions, cfg, progress, result["tier"])
    finally:
        writer.close()
    result["write_seconds"] = time.perf_counter() - t0
    result["write_gbps"] = result["data_bytes"] / result["write_seconds"] / 1e9
    bufs = [alloc(chunk_bytes) for _ in range(cfg.session_chunks)]

    # 2. one chunk at a time
    store = TieredStore(StoreConfig(tiers=(first,), promote=False))
    try:
        single = []
        all_keys = [k for keys in sessions for k in keys]
        tick = progress("single-chunk loads", len(all_keys))
        for k in all_keys:
            s0 = time.perf_counter()
            if store.load([k], bufs[:1]) != 1:
                raise StorageBenchError(f"single-chunk load missed: storage trouble at {result['tier']}, see the log")
            single.append(time.perf_counter() - s0)
            tick(1)
    finally:
        store.close()
    result["chunk_load"] = {"samples": len(single), "p50_ms": _pct(single, 0.5) * 1e3, "p99_ms": _pct(single, 0.99) * 1e3}

    # 3. sessions at each window
    stores = {w: TieredStore(StoreConfig(tiers=(tier_spec(url, cfg, w),), promote=False)) for w in cfg.windows}
    timers = {w: _ReadTimer(s.tiers[0]) for w, s in stores.items()}
    runs: dict[int, list[float]] = {w: [] for w in cfg.windows}
    per_load: dict[int, list[float]] = {w: [] for w in cfg.windows}
    reads: dict[int, list[float]] = {w: [] for w in cfg.windows}
    tick = progress("session loads", cfg.repeats * len(cfg.windows) * len(sessions))
    try:
        for _ in range(cfg.repeats):
            for w, store in stores.items():
                runs[w].append(load_sessions(store, sessions, bufs, per_load[w], tick, "load", f"at {result['tier']}, see the log"))
                reads[w] += timers[w].take()
    finally:
        for s in stores.values():
            s.close()
    cold = {
        f"{w // MiB}MiB": {
            "window_bytes": w,
            "runs_gbps": runs[w],
            "median_gbps": _median(runs[w]),
            "session_load_p50_s": _median(per_load[w]),
            "session_load_p99_s": _pct(per_load[w], 0.99),
            "chunk_read_p50_ms": _pct(reads[w], 0.5) * 1e3,
            "chunk_read_p99_ms": _pct(reads[w], 0.99) * 1e3,
        }
        for w in cfg.windows
    }
    result["cold"] = cold
    best = max(cold, key=lambda w: cold[w]["median_gbps"])
    result["cold_best_window"] = best
    result["cold_load_gbps"] = cold[best]["median_gbps"]

    # 4. memory tier vs memcpy
    result.update(_memory_bench(cfg, sessions, tier_spec(url, cfg, 64 * MiB), bufs, progress))
    result["memory_vs_memcpy"] = result["memory_load_gbps"] / result["memcpy_gbps"]
    result["seconds"] = time.perf_counter() - t_start
    return result


def format_table(r: dict) -> str:
    lines = [
        f"kvtier bench storage  {r['tier']} ({r['kind']})",
        f"data: {r['data_bytes'] / GiB:.2f} GiB in {r['chunks']} chunks of {r['chunk_bytes'] / MiB:.2f} MiB "
        f"({r['model']['name']}, {r['chunk_tokens']} tokens/chunk, {r['sessions']} sessions, "
        f"{r['io_threads']} I/O threads); medians of {r['repeats']} runs",
        f"fio: skipped ({r['fio_skipped']})",
        "",
        f"{'measurement':<30}{'GB/s':>7}  {'session p50':>11}  {'chunk p50':>9}  {'chunk p99':>9}",
        "-" * 72,
        f"{'first write (batched)':<30}{r['write_gbps']:>7.2f}",
        f"{'one chunk at a time':<30}{'':>7}  {'':>11}  {r['chunk_load']['p50_ms']:>7.1f}ms  {r['chunk_load']['p99_ms']:>7.1f}ms",
    ]
    for w, v in r["cold"].items():
        mark = " *" if w == r["cold_best_window"] else ""
        lines.append(
            f"{'load, window ' + w:<30}{v['median_gbps']:>7.2f}  {v['session_load_p50_s'] * 1e3:>9.0f}ms  "
            f"{v['chunk_read_p50_ms']:>7.1f}ms  {v['chunk_read_p99_ms']:>7.1f}ms{mark}"
        )
    lines.append(f"{'memcpy (same bytes)':<30}{r['memcpy_gbps']:>7.2f}")
    lines.append(f"{'kvtier memory-tier load':<30}{r['memory_load_gbps']:>7.2f}  ({r['memory_vs_memcpy']:.2f} x memcpy)")
    lines.append("")
    lines.append(
        "chunk p50/p99: one chunk's read (GET and verify) under the window's concurrency; "
        "'one chunk at a time': a whole single-chunk load, lookup included."
    )
    return "\n".join(lines)
