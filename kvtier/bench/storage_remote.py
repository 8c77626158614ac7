"""``kvtier bench storage --tier URL``: the storage benchmark on a network tier
(Redis/Valkey, S3), against what the server itself can deliver.

In one run, on one tier (a URL as in the config, e.g. ``redis://host:6379``,
``s3://bucket/prefix?endpoint=http://host:8333``):
1. write ``size`` bytes of chunk objects shaped like a real model's KV, as
   write-through would (sessions of ``session_chunks`` chunks, batched);
2. single-chunk loads, one at a time: the latency one chunk costs without
   contention (p50/p99 over every chunk);
3. session loads through ``TieredStore.load`` at several read windows:
   throughput, CPU seconds per GB (this process, every thread), the time of
   one session's load, and the latency of each chunk read under that
   window's concurrency (p50/p99); interleaved repeat by repeat with
4. the ceiling at the same window (``ceiling``): the server's own
   ``redis-benchmark`` GETs of the same objects, or plain parallel S3 GETs
   of the same objects (boto3, and awscrt where installed), as many in
   flight as kvtier has; kvtier's load is reported as a fraction of it;
5. memory-tier loads (promoted from the tier) against memcpy, as with ``--dir``.

fio is skipped, and said so in the report: it measures block devices and
file systems. Server-side caches cannot be dropped from here: Redis serves
from memory anyway; an S3 server may serve from its own page cache (for
kvtier and the ceiling alike). A missing ceiling tool skips the ceiling only,
with the reason in the report.

The data is kept for reruns (a rerun skips existing objects). It is written
under its own namespace; Redis gets the key prefix ``kvtier-bench:v1:`` unless
the URL names one (kvtier's capacity budget is per prefix, so the benchmark
never evicts another prefix's objects), and S3 runs no collection pass: give
the benchmark a prefix or database of its own. The ceiling only reads.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from kvtier.bench import ceiling
from kvtier.bench.ceiling import concurrency
from kvtier.bench.storage_common import (
    GiB,
    LoadPass,
    MiB,
    StorageBenchConfig,
    StorageBenchError,
    host,
    load_sessions,
    median,
    memory_bench,
    namespace,
    pct,
    populate,
    sessions as make_sessions,
    summarize,
)
from kvtier.buffers import alloc
from kvtier.config import ConfigError, StoreConfig, TierSpec, parse_tier, parse_tier_url, with_env_secrets
from kvtier.engine.store import TieredStore
from kvtier.progress import Progress, silent
from kvtier.tiers import registry
from kvtier.version import __version__

KINDS = ("redis", "s3")


def tier_spec(url: str, cfg: StorageBenchConfig, window: int) -> TierSpec:
    """The tier of ``url`` with the benchmark's window, threads and (unless
    the URL sets it) capacity; raises ConfigError naming ``--tier``."""
    values: dict[str, Any] = parse_tier_url(url, "--tier")
    kind = values["kind"]
    if kind not in KINDS:
        raise ConfigError("--tier", f"{kind}:// is not a network tier", "use --dir for directories; --tier takes redis:// or s3://")
    values.setdefault("capacity", f"{4 * cfg.size_bytes + GiB}B")
    values["read_window_bytes"] = f"{window}B"
    values["io_threads"] = cfg.io_threads
    values.setdefault("name", kind)
    if kind == "redis":
        values.setdefault("key_prefix", "kvtier-bench:v1:")
        values.setdefault("pool_size", cfg.io_threads + 4)
    else:
        values.setdefault("gc_interval_s", 0)  # the benchmark's data is never collected mid-run
    # Credentials: from the same KVTIER_* variables as the engine's (a URL
    # holds none: parse_tier_url refuses them).
    return with_env_secrets(parse_tier(values, "--tier"), os.environ)


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


def run(cfg: StorageBenchConfig, progress: Progress = silent) -> dict:
    url = cfg.tier
    assert url is not None
    first = tier_spec(url, cfg, cfg.windows[0])
    sessions = make_sessions(cfg, namespace(cfg))
    chunk_bytes = cfg.model.bytes_per_token * cfg.chunk_tokens
    result: dict = {
        "kvtier_version": __version__,
        "tier": url,
        "kind": first.kind,
        "host": host(),
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
        result["data_bytes"] = populate(writer, sessions, cfg, progress, result["tier"])
    finally:
        writer.close()
    result["write_seconds"] = time.perf_counter() - t0
    result["write_gbps"] = result["data_bytes"] / result["write_seconds"] / 1e9
    bufs = [alloc(chunk_bytes) for _ in range(cfg.session_chunks)]
    object_bytes = result["data_bytes"] // result["chunks"]  # every chunk is full-sized

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
    result["chunk_load"] = {"samples": len(single), "p50_ms": pct(single, 0.5) * 1e3, "p99_ms": pct(single, 0.99) * 1e3}

    # 3+4. sessions at each window, each pass followed by the ceiling at the
    # same concurrency, so that both see the same server and machine load.
    stores = {w: TieredStore(StoreConfig(tiers=(tier_spec(url, cfg, w),), promote=False)) for w in cfg.windows}
    timers = {w: _ReadTimer(s.tiers[0]) for w, s in stores.items()}
    runs: dict[int, list[LoadPass]] = {w: [] for w in cfg.windows}
    per_load: dict[int, list[float]] = {w: [] for w in cfg.windows}
    reads: dict[int, list[float]] = {w: [] for w in cfg.windows}
    roof = Ceiling.open(first, stores[cfg.windows[0]].tiers[0], all_keys, object_bytes) if cfg.ceiling else None
    if roof is None or roof.skipped:
        result["ceiling"] = None
        result["ceiling_skipped"] = roof.skipped if roof is not None else "not asked for"
    inflight = {w: concurrency(w, object_bytes, cfg.io_threads) for w in cfg.windows}
    ceil_runs: dict[int, dict[str, list[LoadPass]]] = {w: {} for w in cfg.windows}
    tick = progress("session loads + ceiling", cfg.repeats * len(cfg.windows) * (len(sessions) + 1))
    try:
        for _ in range(cfg.repeats):
            for w, store in stores.items():
                runs[w].append(load_sessions(store, sessions, bufs, per_load[w], tick, "load", f"at {result['tier']}, see the log"))
                reads[w] += timers[w].take()
                if roof is not None and not roof.skipped:
                    for client, run_ in roof.measure(inflight[w]).items():
                        ceil_runs[w].setdefault(client, []).append(run_)
                tick(1)
    finally:
        for s in stores.values():
            s.close()
        if roof is not None:
            roof.close()
    cold = {}
    for w in cfg.windows:
        v = {
            "window_bytes": w,
            "concurrency": inflight[w],
            **summarize(runs[w]),
            "session_load_p50_s": median(per_load[w]),
            "session_load_p99_s": pct(per_load[w], 0.99),
            "chunk_read_p50_ms": pct(reads[w], 0.5) * 1e3,
            "chunk_read_p99_ms": pct(reads[w], 0.99) * 1e3,
        }
        cold[f"{w // MiB}MiB"] = v
    result["cold"] = cold
    best = max(cold, key=lambda w: cold[w]["median_gbps"])
    result["cold_best_window"] = best
    result["cold_load_gbps"] = cold[best]["median_gbps"]
    result["cold_cpu_s_per_gb"] = cold[best]["cpu_s_per_gb"]
    if roof is not None and not roof.skipped:
        result.update(_ceiling_results(roof, cold, ceil_runs, best))

    # 5. memory tier vs memcpy
    result.update(memory_bench(cfg, sessions, tier_spec(url, cfg, 64 * MiB), bufs, progress))
    result["memory_vs_memcpy"] = result["memory_load_gbps"] / result["memcpy_gbps"]
    result["seconds"] = time.perf_counter() - t_start
    return result


def _ceiling_results(roof: "Ceiling", cold: dict, ceil_runs: dict, best: str) -> dict:
    """Per window: each client's median and the best of them (the ceiling);
    kvtier's load at that window as a fraction of it. Overall: kvtier's best
    window against the best ceiling of any window (as ``cold_vs_fio``)."""
    windows = {}
    for w, by_client in ceil_runs.items():
        label = f"{w // MiB}MiB"
        clients = {c: summarize(rs) for c, rs in by_client.items()}
        top = max(clients, key=lambda c: clients[c]["median_gbps"])
        windows[label] = {"concurrency": cold[label]["concurrency"], "clients": clients, "best_client": top,
                          "median_gbps": clients[top]["median_gbps"], "cpu_s_per_gb": clients[top]["cpu_s_per_gb"]}
        cold[label]["ceiling_gbps"] = clients[top]["median_gbps"]
        cold[label]["vs_ceiling"] = cold[label]["median_gbps"] / clients[top]["median_gbps"]
    top_w = max(windows, key=lambda w: windows[w]["median_gbps"])
    return {
        "ceiling": {"tool": roof.tool, "object_bytes": roof.object_bytes, "windows": windows},
        "ceiling_skipped": None,
        "ceiling_gbps": windows[top_w]["median_gbps"],
        "ceiling_best_window": top_w,
        "ceiling_cpu_s_per_gb": windows[top_w]["cpu_s_per_gb"],
        "cold_vs_ceiling": cold[best]["median_gbps"] / windows[top_w]["median_gbps"],
    }


class Ceiling:
    """The ceiling of one tier's server (see ``ceiling``): which tool, on
    which objects; ``measure`` runs it once at a concurrency. ``skipped``
    says why there is none (a tool not installed)."""

    def __init__(self, tool: str, object_bytes: int, skipped: str = ""):
        self.tool = tool
        self.object_bytes = object_bytes
        self.skipped = skipped

    @staticmethod
    def open(spec: TierSpec, tier, keys: list, object_bytes: int) -> "Ceiling":
        if spec.kind == "redis":
            return _RedisCeiling.make(spec.config, tier, keys, object_bytes)
        return _S3Ceiling(spec.config, tier, keys, object_bytes)

    def measure(self, clients: int) -> dict[str, LoadPass]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _RedisCeiling(Ceiling):
    @classmethod
    def make(cls, config, tier, keys, object_bytes: int) -> Ceiling:
        try:
            version = ceiling.redis_benchmark_version()
        except ceiling.CeilingMissing as exc:
            return Ceiling("redis-benchmark", object_bytes, skipped=str(exc))
        self = cls(version, object_bytes)
        self.config = config
        self.targets = tier.servers_of(keys)  # one object per server that holds any
        self.requests = len(keys)
        return self

    def measure(self, clients: int) -> dict[str, LoadPass]:
        try:
            # At least 200 GETs: redis-benchmark's clock counts milliseconds.
            run_ = ceiling.redis_get_ceiling(self.config, self.targets, self.object_bytes, clients,
                                             max(self.requests, 200, 4 * clients))
        except RuntimeError as exc:
            raise StorageBenchError(f"the ceiling could not be measured: {exc}") from exc
        return {"redis-benchmark": run_}


class _S3Ceiling(Ceiling):
    def __init__(self, config, tier, keys, object_bytes: int):
        clients = ["boto3", "presigned http.client"] + (["awscrt"] if ceiling.awscrt_available() else [])
        super().__init__("plain GETs: " + ", ".join(clients), object_bytes)
        self.config = config
        self.client = tier.client()
        self.names = [tier.object_name(k) for k in keys]
        self.crt = "awscrt" in clients
        self.tls = tier.tls_context()

    def measure(self, clients: int) -> dict[str, LoadPass]:
        c = self.config
        out = {
            "boto3": ceiling.s3_boto3_ceiling(self.client, c.bucket, self.names, self.object_bytes, clients),
            "presigned http.client": ceiling.s3_presigned_ceiling(self.client, c.bucket, self.names, self.object_bytes,
                                                                  clients, self.tls),
        }
        if self.crt and c.endpoint:
            out["awscrt"] = ceiling.s3_crt_ceiling(
                c.endpoint, c.region or "us-east-1", c.bucket, self.names, self.object_bytes, clients,
                c.access_key_id or os.environ.get("AWS_ACCESS_KEY_ID"),
                c.secret_access_key or os.environ.get("AWS_SECRET_ACCESS_KEY"),
            )
        return out


def format_table(r: dict) -> str:
    lines = [
        f"kvtier bench storage  {r['tier']} ({r['kind']})",
        f"data: {r['data_bytes'] / GiB:.2f} GiB in {r['chunks']} chunks of {r['chunk_bytes'] / MiB:.2f} MiB "
        f"({r['model']['name']}, {r['chunk_tokens']} tokens/chunk, {r['sessions']} sessions, "
        f"{r['io_threads']} I/O threads); medians of {r['repeats']} runs",
        f"fio: skipped ({r['fio_skipped']})",
    ]
    ceil = r.get("ceiling")
    if ceil:
        lines.append(f"ceiling: {ceil['tool']} GETs of the same objects, as many in flight as kvtier")
    else:
        lines.append(f"ceiling: skipped ({r.get('ceiling_skipped') or 'not measured'})")
    lines += [
        "",
        f"{'measurement':<44}{'GB/s':>7}  {'x ceiling':>9}  {'CPU s/GB':>8}  {'session p50':>11}  {'chunk p50':>9}  {'chunk p99':>9}",
        "-" * 109,
        f"{'first write (batched)':<44}{r['write_gbps']:>7.2f}",
        f"{'one chunk at a time':<44}{'':>7}  {'':>9}  {'':>8}  {'':>11}  {r['chunk_load']['p50_ms']:>7.1f}ms  "
        f"{r['chunk_load']['p99_ms']:>7.1f}ms",
    ]
    for w, v in r["cold"].items():
        mark = " *" if w == r["cold_best_window"] else ""
        ratio = f"{v['vs_ceiling']:>9.2f}" if "vs_ceiling" in v else f"{'':>9}"
        lines.append(
            f"{'load, window ' + w + ' (' + str(v['concurrency']) + ' in flight)':<44}{v['median_gbps']:>7.2f}  {ratio}  "
            f"{v['cpu_s_per_gb']:>8.3f}  {v['session_load_p50_s'] * 1e3:>9.0f}ms  "
            f"{v['chunk_read_p50_ms']:>7.1f}ms  {v['chunk_read_p99_ms']:>7.1f}ms{mark}"
        )
        if ceil:
            for client, c in ceil["windows"][w]["clients"].items():
                lines.append(f"{'  ceiling: ' + client + ' GET x' + str(v['concurrency']):<44}{c['median_gbps']:>7.2f}  "
                             f"{'':>9}  {c['cpu_s_per_gb']:>8.3f}")
    lines.append(f"{'memcpy (same bytes)':<44}{r['memcpy_gbps']:>7.2f}")
    lines.append(f"{'kvtier memory-tier load':<44}{r['memory_load_gbps']:>7.2f}  ({r['memory_vs_memcpy']:.2f} x memcpy)")
    lines.append("")
    if ceil:
        lines.append(
            f"load (best window {r['cold_best_window']}) = {r['cold_vs_ceiling']:.2f} x the ceiling "
            f"({r['ceiling_gbps']:.2f} GB/s at {r['ceiling_best_window']}); CPU per GB loaded: kvtier "
            f"{r['cold_cpu_s_per_gb']:.3f} s, ceiling {r['ceiling_cpu_s_per_gb']:.3f} s"
        )
    else:
        lines.append(f"CPU per GB loaded (best window): kvtier {r['cold_cpu_s_per_gb']:.3f} s; no ceiling to compare with")
    lines.append(
        "chunk p50/p99: one chunk's read (GET and verify) under the window's concurrency; "
        "'one chunk at a time': a whole single-chunk load, lookup included. CPU: user + system of the "
        "client process(es), every thread."
    )
    return "\n".join(lines)
