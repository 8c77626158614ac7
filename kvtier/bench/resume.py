"""``kvtier bench resume``: the cold-resume experiment, configurations side by side.

Workload W1 (long-context cold resume): N sessions of L tokens, together
larger than the engine's KV capacity, are prefilled once (warm), then queried
again in the same order, so every query resumes a session the engine itself
has evicted. Each configuration runs in its own engine process, one after
the other (never two engines at once: they would share the cores):

    recompute        no connector, no prefix cache
    prefix-cache     no connector, vLLM's prefix cache only
    kvtier-memory    kvtier, memory tier
    kvtier-disk      kvtier, local disk tier
    kvtier-shared    kvtier, shared-directory tier, page cache dropped (cold reads)
    example          vLLM's built-in ExampleConnector (disk), the peer baseline

Peers that cannot run on this host are reported with the reason, not dropped.
TTFT is the client-side wall time of one request with ``max_tokens=1``.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvtier.bench.engine_env import engine_env
from kvtier.bench.tinymodels import PRESETS, build_checkpoint, build_config_only

CONFIGS = ("recompute", "prefix-cache", "kvtier-memory", "kvtier-disk", "kvtier-shared", "example")
BLOCK = 128

UNAVAILABLE_PEERS = {
    "lmcache": "LMCache 0.5.6 installs, but its vLLM connector has no CPU path ('No supported cpu connector found')",
    "vllm-offloading": "vLLM's OffloadingConnector and SimpleCPUOffloadConnector refuse the CPU platform",
}


@dataclass(frozen=True)
class ResumeConfig:
    workdir: Path
    model: str = "qwen2.5-0.5b"
    contexts: tuple[int, ...] = (2048, 8192)
    sessions: int = 3
    configs: tuple[str, ...] = CONFIGS
    dummy_weights: bool = True
    seed: int = 0
    engine_timeout_s: float = 3600


@dataclass
class Run:
    config: str
    context: int
    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    resume_wall_s: float = 0.0
    kvtier_metrics: dict = field(default_factory=dict)
    vllm_metrics: dict = field(default_factory=dict)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _spec(cfg: ResumeConfig, name: str, context: int, model_dir: Path, sessions: list[list[int]]) -> dict:
    blocks_per_session = -(-(context + 8) // BLOCK)
    store = cfg.workdir / "stores" / f"{name}-{context}"
    engine = {
        "max_model_len": context + 256,
        # One session and a spare block (plus vLLM's null block): warming the
        # next session evicts the previous one, so every resume misses in vLLM.
        "num_gpu_blocks_override": blocks_per_session + 2,
        "kv_cache_memory_bytes": 4 << 30,
        "enable_prefix_caching": name != "recompute",
    }
    if cfg.dummy_weights:
        engine.update(load_format="dummy", dtype="bfloat16")
    kvtier = None
    tiers = {
        "kvtier-memory": [{"kind": "memory", "capacity": "8GiB"}],
        "kvtier-disk": [{"kind": "disk", "path": str(store), "capacity": "32GiB"}],
        "kvtier-shared": [{"kind": "shared", "path": str(store), "capacity": "32GiB"}],
    }
    if name in tiers:
        kvtier = {"chunk_tokens": 256, "tiers": tiers[name]}
    if name == "example":
        engine["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    prompts = [{"tokens": s} for s in sessions]
    resume = {"name": "resume", "prompts": prompts, "max_tokens": 1}
    if name == "kvtier-shared":
        resume["drop_page_cache"] = True
    return {"model": str(model_dir), "kvtier": kvtier, "engine": engine,
            "phases": [{"name": "warm", "prompts": prompts, "max_tokens": 1}, resume]}


def run(cfg: ResumeConfig, progress: Callable[[str, int], Callable[[int], None]] | None = None, log=print) -> dict:
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    max_len = max(cfg.contexts) + 256
    if cfg.dummy_weights:
        model_dir = build_config_only(cfg.model, cfg.workdir / "models" / cfg.model, max_len=max_len)
    else:
        model_dir = build_checkpoint(cfg.model, cfg.workdir / "models" / f"{cfg.model}-ckpt", max_len=max_len)
    vocab = PRESETS[cfg.model][6]
    tick = (progress or (lambda d, t: (lambda n: None)))("engine runs", len(cfg.contexts) * len(cfg.configs))
    runs: list[Run] = []
    for context in cfg.contexts:
        rng = random.Random(cfg.seed * 1000 + context)
        sessions = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(cfg.sessions)]
        for name in cfg.configs:
            runs.append(_run_one(cfg, name, context, model_dir, sessions, log))
            tick(1)
    return summarise(cfg, runs)


def _run_one(cfg: ResumeConfig, name: str, context: int, model_dir: Path, sessions, log) -> Run:
    spec = _spec(cfg, name, context, model_dir, sessions)
    logs = cfg.workdir / "logs"
    logs.mkdir(exist_ok=True)
    engine_log = logs / f"{name}-{context}.log"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        with open(engine_log, "w") as f:
            proc = subprocess.run([sys.executable, "-m", "kvtier.bench.vllm_runner", str(spec_path), str(out_path)],
                                  stdout=f, stderr=subprocess.STDOUT, timeout=cfg.engine_timeout_s, env=engine_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{name} at {context} tokens failed (exit {proc.returncode}); log: {engine_log}\n"
                               + engine_log.read_text()[-2000:])
        out = json.loads(out_path.read_text())
    resume = next(p for p in out["phases"] if p["name"] == "resume")["results"]
    return Run(name, context, [r["wall_s"] for r in resume], [r["num_cached_tokens"] for r in resume],
               sum(r["wall_s"] for r in resume), out.get("kvtier_metrics", {}), out.get("metrics", {}))


def _hit_tokens(run: Run) -> dict[str, float]:
    out = {}
    for k, v in run.kvtier_metrics.items():
        if k.startswith("kvtier_vllm_external_hit_tokens_total{tier="):
            out[k.split("tier=")[1].rstrip("}")] = v
    return out


def summarise(cfg: ResumeConfig, runs: list[Run]) -> dict:
    results: dict = {}
    for r in runs:
        m = r.kvtier_metrics
        read = sum(v for k, v in m.items() if k.startswith("kvtier_read_bytes_total"))
        written = sum(v for k, v in m.items() if k.startswith("kvtier_written_bytes_total"))
        loads = m.get("kvtier_vllm_load_seconds_count", 0)
        results.setdefault(str(r.context), {})[r.config] = {
            "ttft_p50_s": _pct(r.ttft_s, 0.5),
            "ttft_p90_s": _pct(r.ttft_s, 0.9),
            "ttft_p99_s": _pct(r.ttft_s, 0.99),
            "ttft_s": r.ttft_s,
            "throughput_rps": len(r.ttft_s) / r.resume_wall_s if r.resume_wall_s else 0.0,
            "prompt_tokens_per_s": len(r.ttft_s) * r.context / r.resume_wall_s if r.resume_wall_s else 0.0,
            "cached_tokens_p50": statistics.median(r.cached_tokens) if r.cached_tokens else 0,
            "hit_tokens": _hit_tokens(r),
            "vllm_external_prefix_cache_hits": r.vllm_metrics.get("vllm:external_prefix_cache_hits", 0.0),
            "kvtier_read_bytes": read,
            "kvtier_written_bytes": written,
            "kvtier_load_s_mean": m.get("kvtier_vllm_load_seconds_sum", 0.0) / loads if loads else None,
        }
    for ctx, by in results.items():
        base = by.get("recompute", {}).get("ttft_p50_s")
        for v in by.values():
            v["speedup_vs_recompute"] = base / v["ttft_p50_s"] if base and v["ttft_p50_s"] else None
    return {
        "workload": "W1 long-context cold resume",
        "model": cfg.model,
        "dummy_weights": cfg.dummy_weights,
        "sessions": cfg.sessions,
        "contexts": list(cfg.contexts),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unavailable_peers": UNAVAILABLE_PEERS,
        "results": results,
    }


def format_table(s: dict) -> str:
    lines = [f"kvtier bench resume: {s['workload']}, {s['model']}"
             f"{' (dummy weights)' if s['dummy_weights'] else ''}, {s['sessions']} sessions per context", ""]
    head = f"{'context':>8}  {'configuration':<15}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'req/s':>8}{'cached':>8}{'speedup':>9}"
    lines += [head, "-" * len(head)]
    for ctx, by in s["results"].items():
        for name, v in by.items():
            sp = v["speedup_vs_recompute"]
            lines.append(f"{ctx:>8}  {name:<15}{v['ttft_p50_s']:>9.3f}s{v['ttft_p90_s']:>8.3f}s{v['ttft_p99_s']:>8.3f}s"
                         f"{v['throughput_rps']:>8.2f}{v['cached_tokens_p50']:>8.0f}{(f'{sp:.1f}x' if sp else '-'):>9}")
    lines += ["", "not run on this host:"] + [f"  {k}: {why}" for k, why in s["unavailable_peers"].items()]
    return "\n".join(lines)


def write_report(s: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and PNG plots in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(s, indent=2) + "\n")
    paths[1].write_text("# kvtier bench resume\n\n```\n" + format_table(s) + "\n```\n\n"
                        "![TTFT CDF](ttft_cdf.png)\n\n![speedup](speedup.png)\n\n![hits per tier](hits.png)\n")
    try:
        paths += _plots(s, out_dir)
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'kvtier[bench]')", file=sys.stderr)
    return paths


def _plots(s: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    ctxs = list(s["results"])
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for name, v in s["results"][ctx].items():
            xs = sorted(v["ttft_s"])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{ctx}-token sessions")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(out_dir / "ttft_cdf.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [n for n in s["results"][ctxs[0]] if n != "recompute"]
    for name in names:
        ys = [s["results"][c].get(name, {}).get("speedup_vs_recompute") or 0 for c in ctxs]
        ax.plot([int(c) for c in ctxs], ys, marker="o", label=name)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("TTFT speedup vs recompute (p50)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(out_dir / "speedup.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, bottoms = [], []
    tiers = sorted({t for by in s["results"].values() for v in by.values() for t in v["hit_tokens"]})
    bars = [(c, n) for c in ctxs for n in s["results"][c] if n.startswith("kvtier")]
    bottoms = [0.0] * len(bars)
    for t in tiers:
        vals = [s["results"][c][n]["hit_tokens"].get(t, 0) for c, n in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, label=t)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    labels = [f"{n}\n{c}" for c, n in bars]
    ax.set_xticks(range(len(bars)), labels, fontsize=7)
    ax.set_ylabel("tokens served by kvtier")
    if tiers:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(out_dir / "hits.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out
