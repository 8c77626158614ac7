"""Figures, table, Markdown and plots of ``kvtier bench resume``.

``summarise`` turns the runs (driver records and metrics of each
configuration) into per-configuration figures and the ratios the acceptance
bars are stated in; everything it reports is computed from those runs.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from kvtier.bench.endpoint import by_label

# Acceptance bars of the benchmark issue, checked on every run that has the
# configurations they compare.
BARS = {
    "speedup_shared_vs_recompute": 30.0,   # W1: at least
    "shared_over_floor": 1.2,              # W1: at most
    "load_vs_example": 0.5,                # W1: at most
    "w3_throughput_gain": 0.30,            # W3: at least
    "w0_overhead": 0.03,                   # W0: at most
    "multiprocess_vs_single": 1.05,        # any: the worst kvtier+mp / kvtier TTFT p50, at most
    "throttled_vs_recompute": 1.05,        # any: kvtier on storage slower than prefill / recompute TTFT p50, at most
}
AT_MOST = ("shared_over_floor", "load_vs_example", "w0_overhead", "multiprocess_vs_single", "throttled_vs_recompute")
MP = "+mp"


SPEEDUP_FROM_TOKENS = 8192


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _tier_hits(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if k.startswith("kvtier_vllm_external_hit_tokens_total{tier="):
            out[k.split("tier=")[1].rstrip("}")] = v
    return out


def noise(v: dict) -> float:
    """A configuration's own spread in this run: half the range of its
    requests' TTFTs (what two runs of the same thing may differ by)."""
    xs = v.get("ttft_s") or []
    return (max(xs) - min(xs)) / 2 if len(xs) >= 2 else 0.0


def _figures(runs: list[dict]) -> dict:
    """Figures of one configuration on one case, over its rounds."""
    recs = [rec for r in runs for rec in r["records"] if rec["phase"] in r["measured"]]
    ttft = [rec["ttft_s"] for rec in recs]
    thr, tok = [], []
    for r in runs:
        mine = [rec for rec in r["records"] if rec["phase"] in r["measured"]]
        span = sum(r["span_s"].get(p, 0.0) for p in r["measured"])
        if span > 0:
            thr.append(len(mine) / span)
            tok.append(sum(rec["prompt_tokens"] for rec in mine) / span)
    m: dict = {}
    for r in runs:
        for k, v in r["kvtier_metrics"].items():
            m[k] = m.get(k, 0) + v
    vm: dict = {}
    for r in runs:
        for k, v in r["vllm_metrics"].items():
            vm[k] = vm.get(k, 0) + v
    loads = m.get("kvtier_vllm_load_seconds_count", 0)
    read_bytes = sum(v for k, v in m.items() if k.startswith("kvtier_read_bytes_total"))
    # What kvtier's reads cost in CPU (its tiers' threads on load jobs and
    # the loading thread inside its loads: docs/metrics.md), per GB read.
    caller_cpu = m.get("kvtier_load_caller_cpu_seconds_total", 0.0)
    tiers_cpu = by_label(m, "kvtier_io_cpu_seconds_total", "kind").get("load", 0.0)
    read_cpu = caller_cpu + tiers_cpu
    prompt = sum(rec["prompt_tokens"] for rec in recs)
    cached = sum(rec["cached_tokens"] for rec in recs)
    return {
        "requests": len(recs),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_s": ttft,
        "queue_p50_s": pct([rec["queue_s"] for rec in recs], 0.5),
        "throughput_rps": statistics.median(thr) if thr else 0.0,
        "throughput_rps_rounds": thr,
        "prompt_tokens_per_s": statistics.median(tok) if tok else 0.0,
        "cached_tokens_p50": statistics.median(rec["cached_tokens"] for rec in recs) if recs else 0,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "hit_tokens": _tier_hits(m),
        "vllm_external_prefix_cache_hits": vm.get("vllm:external_prefix_cache_hits", 0.0),
        "kvtier_read_bytes": read_bytes,
        "kvtier_read_cpu_s_per_gb": read_cpu / (read_bytes / 1e9) if read_bytes else None,
        # Its two parts, in seconds: the tiers' own threads, the loading threads.
        "kvtier_read_cpu_s": {"tier_threads": tiers_cpu, "loading_threads": caller_cpu},
        "kvtier_written_bytes": sum(v for k, v in m.items() if k.startswith("kvtier_written_bytes_total")),
        "kvtier_load_s_mean": m.get("kvtier_vllm_load_seconds_sum", 0.0) / loads if loads else None,
        "kvtier_lookup_s_mean": (m.get("kvtier_vllm_lookup_seconds_sum", 0.0) / m["kvtier_vllm_lookup_seconds_count"]
                                 if m.get("kvtier_vllm_lookup_seconds_count") else None),
        "kvtier_lookups_deferred": m.get("kvtier_vllm_lookup_deferred_total", 0),
        # Directory tiers' loads by what drove their reads.
        "kvtier_load_drivers": by_label(m, "kvtier_load_drivers_total", "driver"),
    }


def _ratios(workload: str, by: dict, fio: dict | None, case: str = "") -> dict:
    """The ratios the bars are stated in, for one case."""
    out: dict = {}
    rec = by.get("recompute", {}).get("ttft_p50_s")
    for v in by.values():
        v["speedup_vs_recompute"] = rec / v["ttft_p50_s"] if rec and v["ttft_p50_s"] else None
    mem = by.get("kvtier-memory", {}).get("ttft_p50_s")
    if workload == "w1" and mem:
        # Load time over a memory hit: what a configuration adds to the
        # engine's own TTFT on a hit it does not have to read; reading the
        # bytes from storage is part of it.
        for v in by.values():
            v["load_s"] = v["ttft_p50_s"] - mem
        sh, ex = by.get("kvtier-shared"), by.get("example")
        # The speedup bar is stated for long contexts (8k tokens and more);
        # shorter ones show their speedup in the table only.
        if sh and sh["speedup_vs_recompute"] and (not case.isdigit() or int(case) >= SPEEDUP_FROM_TOKENS):
            out["speedup_shared_vs_recompute"] = sh["speedup_vs_recompute"]
        key = "load_s"
        if sh and fio and fio.get("best_gbps"):
            per_resume = sh["kvtier_read_bytes"] / max(1, sh["requests"])
            floor = mem + per_resume / (fio["best_gbps"] * 1e9)
            sh["floor_s"] = floor
            out["floor_s"] = floor
            out["shared_over_floor"] = sh["ttft_p50_s"] / floor
            # The bar's load time: TTFT minus the floor, i.e. the time spent
            # beyond reading the session's bytes at the storage's own speed
            # (the same bytes for every connector).
            for name, v in by.items():
                if name.startswith("kvtier") or name == "example":
                    v["over_floor_s"] = v["ttft_p50_s"] - floor
            key = "over_floor_s"
        out["load_measure"] = key
        if sh and ex:
            base = ex[key]
            for name, v in by.items():
                if name.startswith("kvtier") and base > noise(ex):
                    # At or under the floor counts as no load at all.
                    v["load_vs_example"] = max(0.0, v[key]) / base
            # None: example's load is within its own spread in this run (or
            # under the floor), so there is nothing to divide by.
            out["load_vs_example"] = sh.get("load_vs_example")
            if ex["load_s"] > 0:  # the stricter view, reads included (not a bar)
                out["load_incl_reads_vs_example"] = max(0.0, sh["load_s"]) / ex["load_s"]
        if ex and sh:
            # A difference within the run's own spread is a tie, not a win
            # or a loss: on a noisy host the order of close p50s is chance.
            verdicts = {}
            for n, v in by.items():
                if n.startswith("kvtier"):
                    diff, spread = v["ttft_p50_s"] - ex["ttft_p50_s"], max(noise(v), noise(ex))
                    verdicts[n] = {"diff_s": diff, "noise_s": spread,
                                   "verdict": "below" if diff < 0 else "tie" if diff <= spread else "above"}
            out["ttft_vs_example"] = verdicts
            out["lower_ttft_than_example"] = float(all(d["verdict"] != "above" for d in verdicts.values()))
    # Each configuration in vLLM's multiprocess mode against its own run in
    # one process (the same workload, the same host minutes).
    per_mode = {n: v["ttft_p50_s"] / by[n.removesuffix(MP)]["ttft_p50_s"] for n, v in by.items()
                if n.endswith(MP) and by.get(n.removesuffix(MP), {}).get("ttft_p50_s")}
    if per_mode:
        for n, r in per_mode.items():
            by[n]["vs_single_process"] = r
        out["multiprocess_each"] = per_mode
        out["multiprocess_vs_single"] = max(per_mode.values())
    slow = by.get("kvtier-throttled", {}).get("ttft_p50_s")
    if slow and rec:
        # Storage slower than the engine computes: kvtier must cost what
        # recomputing costs, not what the slow reads would.
        out["throttled_vs_recompute"] = slow / rec
    if workload == "w3" and "kvtier-shared" in by and "kvtier-local-disk" in by:
        loc = by["kvtier-local-disk"]["throughput_rps"]
        if loc:
            out["w3_throughput_gain"] = by["kvtier-shared"]["throughput_rps"] / loc - 1
            out["w3_ttft_p50_reduction"] = 1 - by["kvtier-shared"]["ttft_p50_s"] / by["kvtier-local-disk"]["ttft_p50_s"]
    if workload == "w0" and "prefix-cache" in by and "kvtier-shared" in by:
        # Rounds alternate the two configurations: compare each round's pair
        # (the host's drift hits both alike), then take the median.
        base, ours = by["prefix-cache"]["throughput_rps_rounds"], by["kvtier-shared"]["throughput_rps_rounds"]
        pairs = [o / b for o, b in zip(ours, base) if b]
        if pairs:
            out["w0_round_ratios"] = pairs
            out["w0_overhead"] = 1 - statistics.median(pairs)
    return out


def _checks(ratios: dict) -> dict:
    out = {}
    for k, bar in BARS.items():
        if k in ratios:
            at_most = k in AT_MOST
            v = ratios[k]
            if v is None:
                out[k] = {"value": None, "bar": bar, "kind": "at most" if at_most else "at least", "met": None,
                          "why": "not measurable: the baseline's load time is within this run's own spread"}
                continue
            out[k] = {"value": v, "bar": bar, "kind": "at most" if at_most else "at least",
                      "met": v <= bar if at_most else v >= bar}
    if "lower_ttft_than_example" in ratios:
        vs = ratios.get("ttft_vs_example", {})
        ties = sorted(n for n, d in vs.items() if d["verdict"] == "tie")
        # The configurations that lost, by how much and against what spread:
        # what a reader of a missed bar needs first.
        above = {n: {"diff_s": d["diff_s"], "noise_s": d["noise_s"]} for n, d in sorted(vs.items())
                 if d["verdict"] == "above"}
        out["lower_ttft_than_example"] = {"value": ratios["lower_ttft_than_example"], "bar": 1.0,
                                          "kind": "all kvtier TTFT p50 below example's, or tied within the run's spread",
                                          "met": ratios["lower_ttft_than_example"] == 1.0, "ties": ties,
                                          "above": above}
    return out


def summarise(cfg, runs: list[dict], fio: dict, unavailable: dict) -> dict:
    results: dict = {}
    ratios: dict = {}
    grouped: dict = {}
    for r in runs:
        grouped.setdefault(r["case"], {}).setdefault(r["config"], []).append(r)
    for case, by_config in grouped.items():
        results[case] = {name: _figures(rs) for name, rs in by_config.items()}
        ratios[case] = _ratios(cfg.workload, results[case], fio.get(case), case)
    first = runs[0] if runs else {}
    return {
        "workload": cfg.workload.upper(),
        "description": _describe(cfg),
        "model": cfg.model,
        "dummy_weights": cfg.dummy_weights,
        "dtype": _dtype(cfg),
        "sessions": cfg.sessions,
        "rounds": cfg.repeats if cfg.workload == "w0" else getattr(cfg, "rounds", 1),
        "warmup": getattr(cfg, "warmup", False),
        "contexts": list(cfg.contexts),
        "instances": first.get("instances", 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unavailable_peers": unavailable,
        "fio": fio,
        "results": results,
        "ratios": ratios,
        "checks": {case: _checks(r) for case, r in ratios.items()},
    }


def _dtype(cfg) -> str:
    from kvtier.bench.tinymodels import resolve_dtype

    return resolve_dtype(getattr(cfg, "dtype", "auto")) if cfg.dummy_weights else "float32"


def _describe(cfg) -> str:
    rounds = f", {cfg.rounds} rounds (ABBA)" if getattr(cfg, "rounds", 1) > 1 and cfg.workload != "w0" else ""
    if getattr(cfg, "warmup", False):
        rounds += ", after an unmeasured warm-up run"
    if cfg.workload == "w1":
        return f"W1 long-context cold resume, {cfg.sessions} sessions per context{rounds}"
    if cfg.workload == "w3":
        return f"W3 multi-instance cold resume, {cfg.instances} instances, {cfg.sessions} sessions per context, random routing{rounds}"
    if cfg.workload == "w0":
        return f"W0 zero-hit overhead, {cfg.sessions} distinct prompts per context, {cfg.repeats} alternating rounds"
    c = cfg.chat
    return (f"W2 multi-turn chat, {c.sessions} sessions of {c.turns[0]}-{c.turns[1]} turns, {c.system_tokens}-token "
            f"shared system prompt, Poisson arrivals {c.arrival_rate}/s, concurrency {c.concurrency}")


def format_table(s: dict) -> str:
    lines = [f"kvtier bench resume: {s['description']}, {s['model']}"
             f"{' (dummy weights, ' + s.get('dtype', '') + ')' if s['dummy_weights'] else ''}", ""]
    head = (f"{'case':>8}  {'configuration':<18}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'req/s':>8}"
            f"{'cached':>8}{'speedup':>9}")
    lines += [head, "-" * len(head)]
    for case, by in s["results"].items():
        for name, v in by.items():
            sp = v.get("speedup_vs_recompute")
            lines.append(f"{case:>8}  {name:<18}{v['ttft_p50_s']:>9.3f}s{v['ttft_p90_s']:>8.3f}s{v['ttft_p99_s']:>8.3f}s"
                         f"{v['throughput_rps']:>8.2f}{v['cached_fraction']:>7.0%} {(f'{sp:.1f}x' if sp else '-'):>8}")
    loads = [(case, name, v) for case, by in s["results"].items() for name, v in by.items() if "load_s" in v
             and name not in ("recompute", "prefix-cache", "kvtier-memory")]
    if loads:
        # The load, three ways: over a memory hit (reads included), over the
        # floor (the bar's: reads at fio's speed excluded), and kvtier's own
        # reads (its load-seconds metric, mean).
        lines += ["", "load time (TTFT p50 minus the memory tier's; minus the floor; kvtier's reads alone, "
                      "and their CPU per GB read):"]
        for case, name, v in loads:
            own = v.get("kvtier_load_s_mean")
            over = v.get("over_floor_s")
            cpu = v.get("kvtier_read_cpu_s_per_gb")
            lines.append(f"  {case:>8} {name:<18} {_ms(v['load_s'])}"
                         + (f"   over floor {_ms(over)}" if over is not None else "")
                         + (f"   reads {own * 1000:.1f} ms" if own is not None else "")
                         + (f", CPU {cpu:.3f} s/GB" if cpu is not None else ""))
        strict = [(case, r["load_incl_reads_vs_example"]) for case, r in s["ratios"].items()
                  if r.get("load_incl_reads_vs_example") is not None]
        if strict:
            lines.append("  load over a memory hit, kvtier-shared / example (reads included, not a bar): "
                         + ", ".join(f"{case} {v:.2f}" for case, v in strict))
    agree = [(case, name, sum(v["hit_tokens"].values()), v["vllm_external_prefix_cache_hits"])
             for case, by in s["results"].items() for name, v in by.items() if name.startswith("kvtier")]
    if agree:
        lines += ["", "kvtier hit tokens vs vLLM's external prefix-cache hits (must agree):"]
        lines += [f"  {case:>8} {name:<18} {ours:>10.0f} {theirs:>10.0f}  {'agree' if ours == theirs else 'DIFFER'}"
                  for case, name, ours, theirs in agree]
    for case, phases in s.get("per_server", {}).items():
        lines += ["", f"per server ({case}): requests, kvtier hit tokens by tier, vLLM external hits"]
        for phase, servers in phases.items():
            for srv in servers:
                lines.append(f"  {phase:<8} {srv['endpoint']:<28} {srv['requests']:>4}  "
                             f"{srv.get('kvtier_hit_tokens_by_tier', {})}  {srv.get('external_prefix_cache_hits', 0):.0f}")
    modes = [(case, n, r) for case, rr in s["ratios"].items() for n, r in rr.get("multiprocess_each", {}).items()]
    if modes:
        lines += ["", "vLLM's multiprocess mode against one process (TTFT p50, NAME+mp / NAME):"]
        lines += [f"  {case:>8} {n:<18} {r:.3f}" for case, n, r in modes]
    checks = [(case, k, c) for case, cs in s["checks"].items() for k, c in cs.items()]
    if checks:
        lines += ["", "acceptance bars:"]
        for case, k, c in checks:
            if c["met"] is None:
                lines.append(f"  {case:>8} {k:<28} {'-':>5}  ({c['kind']} {c['bar']})  {c['why']}")
                continue
            verdict = "met" if c["met"] else "MISSED"
            if c.get("above"):
                verdict += " (above example's by more than the run's spread: " + ", ".join(
                    f"{n} +{d['diff_s'] * 1e3:.0f} ms, spread {d['noise_s'] * 1e3:.0f} ms" for n, d in c["above"].items()) + ")"
            if c.get("ties"):
                verdict += f" (tie within the run's spread: {', '.join(c['ties'])})"
            lines.append(f"  {case:>8} {k:<28} {c['value']:.3f}  ({c['kind']} {c['bar']})  {verdict}")
    for case, fio in s["fio"].items():
        if fio.get("best_gbps"):
            lines.append(f"  {case:>8} fio sequential read {fio['best_gbps']:.2f} GB/s (best job); floor "
                         f"{s['ratios'][case].get('floor_s', float('nan')):.3f}s")
    lines += ["", "cached = prompt tokens served from a cache (vLLM's or a connector's)",
              "floor = the memory tier's TTFT plus the bytes a resume reads over fio's best read rate: what a "
              "resume from this storage cannot beat",
              "load time = TTFT p50 minus the floor (or minus the memory tier's TTFT): time spent beyond reading "
              "the bytes at the storage's own speed; 'at floor' when a run came in at or under it",
              "tie = a difference smaller than the run's own spread (half the range of the configurations' TTFTs)"]
    lines += [f"note: {n}" for n in s.get("notes", ())]
    for f in s.get("failed", ()):
        last = [ln for ln in f["error"].splitlines() if ln.strip()][-1:]
        lines.append(f"FAILED: {f['config']} ({f['case']}): {last[0] if last else 'no output'}")
    if s["unavailable_peers"]:
        lines += ["not run on this host:"] + [f"  {k}: {why}" for k, why in s["unavailable_peers"].items()]
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x * 1000:>8.1f} ms" if x > 0 else f"{'at floor':>11}"


def write_summary(s: dict, out_dir: Path, stem: str, table: str) -> list[Path]:
    """``STEM.json`` (the summary ``s``) and ``STEM.md`` (``table`` in a code
    block) in ``out_dir``: the report files of a sweep or a goodput run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(s, indent=2) + "\n")
    paths[1].write_text("```\n" + table + "\n```\n")
    return paths


def pyplot():
    """matplotlib's pyplot drawing into files, or None where matplotlib is
    not installed (said on stderr: the report goes on without plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'kvtier[bench]')", file=sys.stderr)
        return None
    return plt


def write_report(s: dict, out_dir: Path) -> list[Path]:
    """results.json, report.md and PNG plots in ``out_dir`` (requests.jsonl,
    the per-request log, is written there by the run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "report.md"]
    paths[0].write_text(json.dumps(s, indent=2) + "\n")
    paths[1].write_text("# kvtier bench resume\n\n```\n" + format_table(s) + "\n```\n\n"
                        "![TTFT CDF](ttft_cdf.png)\n\n![speedup](speedup.png)\n\n![hits per tier](hits.png)\n\n"
                        "Per-request log: `requests.jsonl` (one JSON record per request).\n")
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
    cases = list(s["results"])
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for name, v in s["results"][case].items():
            xs = sorted(v["ttft_s"])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{s['workload']} {case}" + (" tokens" if case.isdigit() else ""))
        ax.legend(fontsize=8)
    out.append(_save(fig, out_dir / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = [n for n in s["results"][cases[0]] if n != "recompute"]
    numeric = all(c.isdigit() for c in cases)
    xs = [int(c) for c in cases] if numeric else list(range(len(cases)))
    for name in names:
        ys = [s["results"][c].get(name, {}).get("speedup_vs_recompute") or 0 for c in cases]
        ax.plot(xs, ys, marker="o", label=name)
    if not numeric:
        ax.set_xticks(xs, cases)
    ax.set_xlabel("context (tokens)" if numeric else "case")
    ax.set_ylabel("TTFT speedup vs recompute (p50)")
    ax.legend(fontsize=8)
    out.append(_save(fig, out_dir / "speedup.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    tiers = sorted({t for by in s["results"].values() for v in by.values() for t in v["hit_tokens"]})
    bars = [(c, n) for c in cases for n in s["results"][c] if n.startswith("kvtier")]
    bottoms = [0.0] * len(bars)
    for t in tiers:
        vals = [s["results"][c][n]["hit_tokens"].get(t, 0) for c, n in bars]
        ax.bar(range(len(bars)), vals, bottom=bottoms, label=t)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(bars)), [f"{n}\n{c}" for c, n in bars], fontsize=7)
    ax.set_ylabel("tokens served by kvtier")
    if tiers:
        ax.legend(fontsize=8)
    out.append(_save(fig, out_dir / "hits.png"))
    return out


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
