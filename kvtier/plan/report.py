"""What a simulation means for purchasing: hit ratios, TTFT, throughput,
capacity curves, the knee, recommendations; as a dict (JSON), a terminal
table, a Markdown report and PNG plots.

Definitions (also printed in the report):

- hit ratio of a tier: prompt tokens it served / all prompt tokens. "engine"
  is the engine's own prefix cache; kvtier's tiers serve what it missed.
- curve of a tier: the share of prompt tokens whose chunk the tier would hold
  at lookup if it had capacity C (every instance C, for per-instance tiers),
  the rest of the stack as configured (``kvtier.plan.stack``).
- knee: the smallest capacity of the curve's grid that reaches 90% of the
  tier's best hit ratio (its value with unbounded capacity);
  recommendation: the smallest that reaches 95%, rounded up to a power of two.
- bandwidth: bytes read from a tier per second of trace time, mean over the
  busy seconds and their 99th percentile; writes are the write-through of
  every new chunk.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

from kvtier.config import fmt_bytes
from kvtier.plan.sim import Simulator
from kvtier.plan.stack import lru_curve, policy_curve, shared_curve

GiB = 1 << 30
KNEE, RECOMMEND = 0.90, 0.95


def fmt_rate(gbps: float) -> str:
    return f"{gbps:.2f} GB/s" if gbps >= 1 else f"{gbps * 1000:.3g} MB/s"


def _pcts(xs) -> dict:
    import numpy as np

    a = np.asarray(xs, dtype=float)
    if not a.size:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


def _grid(cap: int, hi: float, points: int = 24) -> list[int]:
    lo = max(cap / 256, 1 << 20)
    hi = max(hi * 1.25, cap * 2, lo * 4)
    r = (hi / lo) ** (1 / (points - 1))
    return sorted({int(lo * r**i) for i in range(points)} | {int(cap)})


def _nice(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def curves(sim: Simulator) -> dict:
    """Hit ratio against capacity for the engine and each tier."""
    rec = sim.recorder
    if rec is None:
        return {}
    import numpy as np

    from kvtier.plan.stack import lookup_distances

    total = sim.totals.prompt_tokens
    cfg = sim.cfg
    out: dict = {}
    tiers = [("engine", cfg.engine_blocks * cfg.block_tokens * sim.bpt if cfg.engine_blocks else 0)]
    tiers += [(t.kind, t.capacity) for t in cfg.tiers]
    plans = {t.kind: t for t in cfg.tiers}
    for kind, cap in tiers:
        streams = [s for (k, _), s in rec.streams.items() if k == kind]
        if not streams or not cap:
            continue
        t = plans.get(kind)

        def policy_at(c: int, t=t):  # the tier's own policy at capacity c
            return replace(t, capacity=c).policy()

        if kind == "shared":
            args = {"high_watermark": t.high_watermark, "low_watermark": t.low_watermark,
                    "touch_interval_s": t.touch_interval_s, "gc_interval_s": t.gc_interval_s}
            used = sum(v for s in streams for v in s.vals if v >= 0)  # upper bound of what it could hold
            grid = _grid(cap, used / rec.rate, points=12)
            ys = shared_curve(streams, grid, rec.rate, total, args, policy_at)
            best = ys[-1]
        elif t is not None and t.policy_name != "lru":  # not a stack policy: replayed at each capacity
            held = max(sum({k: v for k, v in zip(s.keys, s.vals) if v >= 0}.values()) for s in streams)
            grid = _grid(cap, held / rec.rate, points=12)  # held: all an instance ever held at once, at most
            ys = policy_curve(streams, grid, rec.rate, total, policy_at)
            best = ys[-1]
        else:
            finite = []
            for s in streams:
                d, _ = lookup_distances(s.keys, s.vals)
                finite += [x for x in d if x != float("inf")]
            if kind == "engine":  # distances in blocks; the curve in bytes of KV
                scale = cfg.block_tokens * sim.bpt
                top = (max(finite) / rec.rate * scale) if finite else cap
                grid = _grid(cap, top)
                ys = lru_curve(streams, [g // scale for g in grid], rec.rate, total)
            else:
                top = (max(finite) / rec.rate) if finite else cap
                grid = _grid(cap, top)
                ys = lru_curve(streams, grid, rec.rate, total)
            best = ys[-1]  # the grid ends past the largest finite distance
        knee = next((g for g, y in zip(grid, ys) if best and y >= KNEE * best), None)
        rec95 = next((g for g, y in zip(grid, ys) if best and y >= RECOMMEND * best), None)
        at_cap = float(np.interp(math.log(cap), [math.log(g) for g in grid], ys))
        out[kind] = {"capacity_bytes": grid, "hit_ratio": ys, "configured_bytes": cap, "at_configured": at_cap,
                     "best": best, "knee_bytes": knee, "recommended_bytes": _nice(rec95) if rec95 else None,
                     "per_instance": kind not in ("shared",)}
    return out


def summarise(sim: Simulator, trace_meta: dict, with_curves: bool = True) -> dict:
    import numpy as np

    cfg, tot = sim.cfg, sim.totals
    P = tot.prompt_tokens or 1
    kv_tokens = sum(tot.tier_tokens.values())
    duration = max(tot.t_last - (tot.t_first or 0.0), 1e-9)
    n = cfg.instances
    io: dict = {}
    written = sim.written_bytes()
    for t in cfg.tiers:
        per_s = np.asarray(list(tot.read_by_second[t.kind].values()), dtype=float)
        io[t.kind] = {
            "read_bytes": tot.read_bytes[t.kind],
            "written_bytes": written.get(t.kind, 0),
            "read_gbps_mean": float(per_s.mean()) / 1e9 if per_s.size else 0.0,
            "read_gbps_p99": float(np.percentile(per_s, 99)) / 1e9 if per_s.size else 0.0,
            "write_gbps_mean": written.get(t.kind, 0) / duration / 1e9,
            "configured_gbps": t.io.gbps,
        }
    thr = {}
    for name, busy in (("kvtier", tot.busy_s), ("baseline", tot.baseline_busy_s), ("recompute", tot.recompute_busy_s)):
        # Prefill-bound capacity: requests per second the instances sustain.
        thr[name] = {"requests_per_s": tot.requests * n / busy if busy else 0.0,
                     "prompt_tokens_per_s": tot.prompt_tokens * n / busy if busy else 0.0,
                     "busy_s": busy}
    out = {
        "trace": {**trace_meta, "requests": tot.requests, "prompt_tokens": tot.prompt_tokens, "duration_s": duration},
        "config": {
            "model": cfg.model.name, "bytes_per_token": sim.bpt, "chunk_tokens": cfg.chunk_tokens,
            "block_tokens": cfg.block_tokens, "engine_blocks": cfg.engine_blocks,
            "engine_kv_bytes": (cfg.engine_blocks or 0) * cfg.block_tokens * sim.bpt,
            "instances": n, "routing": cfg.routing, "promote": cfg.promote,
            "tiers": [{"kind": t.kind, "capacity_bytes": t.capacity, "gbps": t.io.gbps, "latency_s": t.io.latency_s,
                       "eviction": t.policy_name} for t in cfg.tiers],
            "prefill": {"a": cfg.prefill.a, "b": cfg.prefill.b, "c": cfg.prefill.c, "source": cfg.prefill.source},
            "copy_gbps": cfg.copy_gbps, "curve_sample": cfg.curve_sample,
        },
        "hit_ratio": {"engine": tot.engine_tokens / P, **{k: v / P for k, v in tot.tier_tokens.items()},
                      "kvtier": kv_tokens / P, "total": (tot.engine_tokens + kv_tokens) / P},
        "hit_tokens": {"engine": tot.engine_tokens, **tot.tier_tokens},
        "ttft_s": {"kvtier": _pcts(sim.ttft), "baseline": _pcts(sim.ttft_baseline), "recompute": _pcts(sim.ttft_recompute)},
        "throughput": thr,
        "io": io,
        "evictions": sim.evictions(),
    }
    # Share of the trace's span the engines spend on prefills: past 1 the
    # queue grows without bound and TTFT measures the backlog.
    out["utilisation"] = {name: v["busy_s"] / (duration * n) for name, v in thr.items()}
    b, k = out["ttft_s"]["baseline"]["p50"], out["ttft_s"]["kvtier"]["p50"]
    out["ttft_speedup_p50"] = b / k if b and k else None
    if with_curves:
        out["curves"] = curves(sim)
    out["recommendation"] = _recommend(out)
    return out


def _recommend(s: dict) -> dict:
    rec: dict = {}
    for kind, c in (s.get("curves") or {}).items():
        if kind == "engine":
            continue
        io = s["io"].get(kind, {})
        per = s["config"]["instances"] if c["per_instance"] else 1
        mem = (s.get("curves") or {}).get("memory")
        # A disk tier only adds what memory (per instance too) cannot hold.
        covered = kind == "disk" and mem is not None and mem["at_configured"] >= RECOMMEND * c["best"]
        rec[kind] = {
            "capacity_bytes": None if covered else c["recommended_bytes"],
            "covered_by_memory": covered,
            "per_instance": c["per_instance"],
            "hit_ratio_at_recommended": None if covered or c["recommended_bytes"] is None else
            _interp(c, c["recommended_bytes"]),
            # Demand of one instance for per-instance tiers, of the mount for the shared one.
            "read_gbps_p99": io.get("read_gbps_p99", 0.0) / per,
            "write_gbps_mean": io.get("write_gbps_mean", 0.0) / per,
        }
    return rec


def _interp(c: dict, x: float) -> float:
    import numpy as np

    return float(np.interp(math.log(x), [math.log(g) for g in c["capacity_bytes"]], c["hit_ratio"]))


# ---------------------------------------------------------------- text


def format_table(s: dict) -> str:
    cfg, tr = s["config"], s["trace"]
    lines = [
        (f"kvtier plan: {tr.get('name', '')} ({tr.get('format', '?')}), {tr['requests']} requests, "
        f"{tr['prompt_tokens'] / 1e6:.2f} M prompt tokens over {tr['duration_s']:.0f} s"),
        f"model {cfg['model']} ({fmt_bytes(cfg['bytes_per_token'])}/token), chunks of {cfg['chunk_tokens']} tokens, "
        f"{cfg['instances']} instance(s), routing {cfg['routing']}, engine KV "
        + (fmt_bytes(cfg["engine_kv_bytes"]) if cfg["engine_blocks"] else "without prefix cache"),
        "",
        f"{'tier':<8}{'capacity':>12}{'hit ratio':>11}{'knee':>12}{'recommend':>12}{'read p99':>11}{'write':>11}",
        "-" * 77,
    ]
    curves = s.get("curves") or {}
    rows = [("engine", cfg["engine_kv_bytes"])] + [(t["kind"], t["capacity_bytes"]) for t in cfg["tiers"]]
    for kind, cap in rows:
        c = curves.get(kind, {})
        io = s["io"].get(kind, {})
        knee = fmt_bytes(c["knee_bytes"]) if c.get("knee_bytes") else "-"
        rec = fmt_bytes(c["recommended_bytes"]) if c.get("recommended_bytes") else "-"
        if (s.get("recommendation") or {}).get(kind, {}).get("covered_by_memory"):
            rec = "(memory)"
        rd = fmt_rate(io["read_gbps_p99"]) if io else "-"
        wr = fmt_rate(io["write_gbps_mean"]) if io else "-"
        capt = fmt_bytes(cap) if cap else "-"
        lines.append(f"{kind:<8}{capt:>12}{100 * s['hit_ratio'].get(kind, 0):>10.1f}%{knee:>12}{rec:>12}{rd:>11}{wr:>11}")
    lines += [f"{'total':<8}{'':>12}{100 * s['hit_ratio']['total']:>10.1f}%", ""]
    lines.append(f"{'TTFT':<22}{'p50':>10}{'p90':>10}{'p99':>10}{'req/s':>10}")
    for name, label in (("kvtier", "with kvtier"), ("baseline", "engine cache only"), ("recompute", "full recompute")):
        t, th = s["ttft_s"][name], s["throughput"][name]
        lines.append(f"{label:<22}{t['p50']:>9.3f}s{t['p90']:>9.3f}s{t['p99']:>9.3f}s{th['requests_per_s']:>10.2f}")
    u = s["utilisation"]
    if max(u["kvtier"], u["baseline"]) > 0.9:
        lines.append(f"\nwarning: engines busy {100 * u['kvtier']:.0f}% of the time with kvtier, {100 * u['baseline']:.0f}% "
                     "without: TTFT is dominated by queueing (more instances, or a calibrated --prefill)")
    if s.get("ttft_speedup_p50"):
        lines.append(f"\nTTFT p50 {s['ttft_speedup_p50']:.2f}x faster than with the engine's prefix cache alone; "
                     f"prefill capacity {s['throughput']['kvtier']['requests_per_s'] / max(s['throughput']['baseline']['requests_per_s'], 1e-12):.2f}x")
    return "\n".join(lines)


def markdown(s: dict, plots: list[str]) -> str:
    cfg, tr = s["config"], s["trace"]
    curves = s.get("curves") or {}
    md = [
        "# KV cache capacity plan",
        "",
        f"Trace **{tr.get('name', '')}** ({tr.get('format', '?')}): {tr['requests']} requests, "
        f"{tr['prompt_tokens']:,} prompt tokens, {tr['duration_s']:.0f} s of traffic. "
        f"Model **{cfg['model']}** ({cfg['bytes_per_token']:,} bytes of KV per token), "
        f"{cfg['instances']} instance(s), routing *{cfg['routing']}*, kvtier chunks of {cfg['chunk_tokens']} tokens, "
        f"engine blocks of {cfg['block_tokens']} tokens, engine KV "
        + (fmt_bytes(cfg["engine_kv_bytes"]) + " per instance." if cfg["engine_blocks"] else "without prefix caching."),
        "",
        "## What to buy",
        "",
        "| tier | simulated capacity | hit ratio | knee (90% of best) | recommended (95%) | hit ratio there | read bandwidth (p99 s) | write bandwidth (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in cfg["tiers"]:
        kind = t["kind"]
        c, r, io = curves.get(kind, {}), (s.get("recommendation") or {}).get(kind, {}), s["io"][kind]
        scope = " per instance" if kind != "shared" else ""
        knee = fmt_bytes(c["knee_bytes"]) if c.get("knee_bytes") else "-"
        rec = fmt_bytes(r["capacity_bytes"]) + scope if r.get("capacity_bytes") else "-"
        if r.get("covered_by_memory"):
            rec = "none: memory holds it"
        there = f"{100 * r['hit_ratio_at_recommended']:.1f}%" if r.get("hit_ratio_at_recommended") is not None else "-"
        per = cfg["instances"] if kind != "shared" else 1
        md.append(f"| {kind} | {fmt_bytes(t['capacity_bytes'])}{scope} | {100 * s['hit_ratio'].get(kind, 0):.1f}% | "
                  f"{knee} | {rec} | {there} | {fmt_rate(io['read_gbps_p99'] / per)}{scope} | "
                  f"{fmt_rate(io['write_gbps_mean'] / per)}{scope} |")
    md += [
        "",
        (f"Engine prefix cache: {100 * s['hit_ratio']['engine']:.1f}% of prompt tokens; kvtier: "
        f"{100 * s['hit_ratio']['kvtier']:.1f}%; together {100 * s['hit_ratio']['total']:.1f}%."),
        "",
        "## Time to first token and throughput",
        "",
        "| | TTFT p50 | p90 | p99 | prefill-bound requests/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, label in (("kvtier", "with kvtier"), ("baseline", "engine prefix cache only"), ("recompute", "every prompt recomputed")):
        t, th = s["ttft_s"][name], s["throughput"][name]
        md.append(f"| {label} | {t['p50']:.3f} s | {t['p90']:.3f} s | {t['p99']:.3f} s | {th['requests_per_s']:.2f} |")
    md.append("")
    for p in plots:
        md.append(f"![{Path(p).stem}]({Path(p).name})")
    if not plots:
        md.append("(plots skipped: matplotlib is not installed; `pip install 'kvtier[bench]'`)")
    pf = cfg["prefill"]
    md += [
        "",
        "## How these figures were made",
        "",
        ("- Every request of the trace was replayed through a model of the engine's prefix cache and of kvtier's "
        "tiers with kvtier's own policies: each tier's eviction policy by bytes ("
        + ", ".join(f"{t['kind']} {t.get('eviction', '')}" for t in cfg["tiers"]) + "), promotion into memory of "
        "what a lower tier serves, write-through of every new chunk to every tier, the shared tier's collector "
        "(`kvtier/plan/`). The models are checked against the real tiers by `tests/plan/`."),
        f"- Prefill cost `a*n + b*n^2 + c` with a={pf['a']:.3g} s/token, b={pf['b']:.3g} s/token^2, c={pf['c']:.3g} s "
        f"({pf['source']}); a hit computes only the uncached tokens against the cached context. Loads: per tier "
        "`latency + bytes / bandwidth` (" + ", ".join(f"{t['kind']} {t['gbps']:g} GB/s" for t in cfg["tiers"])
        + f"), plus the copy into engine blocks at {cfg['copy_gbps']:g} GB/s.",
        ("- Each instance serves prefills one at a time in arrival order; decode steps are not charged. Throughput is "
        "prefill-bound capacity: requests per second of busy engine time."),
        "- Curves: share of prompt tokens whose chunk a tier would hold at lookup with a given capacity (per instance "
        "for memory and disk), the rest of the stack as configured; LRU tiers by stack distances in one pass, the "
        "shared tier and tiers under other policies by replaying their access stream at each capacity"
        + (f"; keys sampled at rate {cfg['curve_sample']:g} (SHARDS)" if cfg["curve_sample"] < 1 else "") + ".",
        ("- Knee: smallest capacity reaching 90% of the tier's best hit ratio; recommendation: 95%, rounded up to a "
        "power of two. Bandwidth: bytes read per second of trace time, p99 over the seconds with reads, for the "
        "whole fleet (divided by the instances for per-instance tiers); writes: every new chunk written through."),
        ("- Not modelled: the answer tokens of a turn being part of the next turn's prompt (a trace gives block ids "
        "of prompts only, so generated chunks are new content), decode time, network contention on the shared mount."),
    ]
    return "\n".join(md) + "\n"


def plots(s: dict, sim: Simulator, out_dir: Path, prefix: str = "") -> list[Path]:
    """hit ratio vs capacity per tier, TTFT CDF. [] when matplotlib is missing (said on stderr)."""
    try:
        import matplotlib
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'kvtier[bench]')", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = []
    curves = s.get("curves") or {}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for kind, c in curves.items():
            xs = np.asarray(c["capacity_bytes"], dtype=float) / GiB
            (line,) = ax.plot(xs, 100 * np.asarray(c["hit_ratio"]), marker=".", label=kind + (" (per instance)" if c["per_instance"] else ""))
            ax.plot([c["configured_bytes"] / GiB], [100 * c["at_configured"]], "o", color=line.get_color(), mfc="none", ms=9)
            if c.get("knee_bytes"):
                ax.axvline(c["knee_bytes"] / GiB, color=line.get_color(), ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (GiB, log)")
        ax.set_ylabel("prompt tokens held at lookup (%)")
        ax.set_title("hit ratio vs capacity (circle: simulated; dotted: knee)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        fig.tight_layout()
        out.append(out_dir / f"{prefix}hit_ratio.png")
        fig.savefig(out[-1], dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, xs in (("with kvtier", sim.ttft), ("engine prefix cache only", sim.ttft_baseline),
                      ("every prompt recomputed", sim.ttft_recompute)):
        a = np.asarray(xs)
        if a.size:
            q = np.linspace(0, 1, min(a.size, 2000))
            ax.plot(np.quantile(a, q), q, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("predicted TTFT (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.append(out_dir / f"{prefix}ttft_cdf.png")
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    return out
