"""Goodput at a TTFT SLO for the multi-turn workload: ``kvtier bench resume
--workload w2 --rates R1,R2,... --slo S``.

An operator's question: how many conversations per second can this engine
start with TTFT p95 under the target, and where does each configuration fall
off? W2 is run at each arrival rate (conversations started per second,
Poisson) and every configuration is judged at each one.

**How rates are run.** Each rate is a phase (``rate-<r>``) of ONE engine run
per configuration, lowest rate first: an engine start costs tens of seconds on
a small host, a phase costs nothing. Every phase is the same conversations
(turn counts, lengths, think times, the arrival gaps' random draws scaled by
1/r) with their token ids remapped through a permutation of the vocabulary of
its own. Shared prefixes stay shared within a phase and nothing is shared
across phases, so no rate is served by what an earlier one left in vLLM's
cache or kvtier's store, and rates differ by their load alone. (Emptying
stores between phases would not do: a shared tier is a directory that a cold
phase only drops from the page cache.)

**The TTFT judged** is the user's: from when a turn is ready (the session
arrived, or the previous answer came back and the think time passed) to its
first token, client-side queueing behind the concurrency bound included; the
engine's own TTFT (from the send) is reported beside it. Figures per rate are
medians over rounds of each round's figure.

**Goodput** at the SLO is the highest rate at which TTFT p95 holds the SLO,
every lower rate holding it too ("none" if the lowest misses); the **knee** is
the first rate that misses. Both are offered rates from the grid: the
sessions completed per second of a finite run also count the drain of its
last conversations, so with few sessions they sit below the rate sustained.

The acceptance bar: kvtier-shared's goodput at least ``BAR`` times prefix
cache alone's. It is judged only where the grid finds prefix cache's knee
(else its goodput is only a lower bound), or where prefix cache misses at
every rate and kvtier holds the SLO at ``BAR`` times the lowest.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from kvtier.bench import workloads as wl
from kvtier.bench.resume_report import pct, pyplot, write_summary

CONFIGS = ("recompute", "prefix-cache", "kvtier-shared")
BAR = 2.0            # kvtier-shared goodput / prefix-cache's, at least
OURS, BASE = "kvtier-shared", "prefix-cache"


def phase_name(rate: float) -> str:
    return f"rate-{rate:g}"


def workload(shape: wl.ChatShape, rates: tuple[float, ...], vocab: int, seed: int = 0) -> wl.Workload:
    """W2 once per rate, lowest first, each rate's tokens distinct (see the
    module docstring)."""
    phases = []
    for k, rate in enumerate(rates):
        base = wl.w2(replace(shape, arrival_rate=rate), vocab, seed)
        perm = list(range(3, vocab))  # ids 0-2 stay out of prompts, as in workloads._tokens
        random.Random(seed * 1009 + k + 1).shuffle(perm)
        reqs = tuple(replace(r, tokens=tuple(perm[t - 3] for t in r.tokens)) for r in base.phases[0].requests)
        phases.append(wl.Phase(phase_name(rate), reqs, concurrency=shape.concurrency))
    return wl.Workload(
        "W2", f"multi-turn chat at {len(rates)} arrival rates ({', '.join(f'{r:g}' for r in rates)}/s): "
        f"{shape.sessions} sessions each, shared {shape.system_tokens}-token system prompt, "
        f"concurrency {shape.concurrency}",
        tuple(phases), params={**asdict(shape), "seed": seed, "rates": list(rates)})


def phase_figures(records: list[dict]) -> dict:
    """One round's figures at one rate, from its driver records."""
    user = [r["t_first"] - r["t_ready"] for r in records]
    engine = [r["ttft_s"] for r in records]
    span = max(r["t_done"] for r in records) - min(r["t_ready"] for r in records) if records else 0.0
    sessions = len({r["session"] for r in records})
    return {
        "requests": len(records), "sessions": sessions, "span_s": span,
        "ttft_p50_s": pct(user, 0.5), "ttft_p95_s": pct(user, 0.95), "ttft_p99_s": pct(user, 0.99),
        "engine_ttft_p95_s": pct(engine, 0.95),
        "sessions_per_s": sessions / span if span > 0 else None,
        "requests_per_s": len(records) / span if span > 0 else None,
    }


def goodput_and_knee(rates: list[float], p95s: list[float], slo_s: float) -> tuple[float | None, float | None]:
    """(goodput, knee) over ascending ``rates``: the highest rate before the
    first whose p95 exceeds ``slo_s``, and that first rate; None where there
    is none (the lowest misses; none misses)."""
    goodput = None
    for rate, p95 in zip(rates, p95s):
        if not p95 <= slo_s:  # a missing figure (NaN) misses
            return goodput, rate
        goodput = rate
    return goodput, None


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(cfg, runs: list[dict], unavailable: dict) -> dict:
    from kvtier.bench.resume_report import _dtype

    rates = list(cfg.rates)
    results: dict = {}
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == name]
        per: dict = {}
        for rate in rates:
            rounds = [phase_figures([rec for rec in r["records"] if rec["phase"] == phase_name(rate)]) for r in mine]
            rounds = [f for f in rounds if f["requests"]]
            fig = {k: _med([f[k] for f in rounds]) for k in rounds[0] if k != "sessions"} if rounds else {}
            fig["rounds"] = rounds
            fig["meets_slo"] = bool(fig.get("ttft_p95_s") is not None and fig["ttft_p95_s"] <= cfg.slo_s)
            per[phase_name(rate)] = fig
        good, knee = goodput_and_knee(rates, [per[phase_name(r)].get("ttft_p95_s", float("nan")) for r in rates],
                                      cfg.slo_s)
        at = per[phase_name(good)] if good is not None else {}
        results[name] = {"rates": per, "goodput_rate": good, "knee_rate": knee,
                         "goodput_sessions_per_s": at.get("sessions_per_s")}
    c = cfg.chat
    summary = {
        "kind": "goodput", "workload": "W2", "model": cfg.model,
        "description": (f"W2 multi-turn chat at arrival rates {', '.join(f'{r:g}' for r in rates)}/s, "
                        f"{c.sessions} sessions of {c.turns[0]}-{c.turns[1]} turns per rate, {c.system_tokens}-token "
                        f"system prompt, users {c.user_tokens[0]}-{c.user_tokens[1]} tokens, think {c.think_s:g} s, "
                        f"concurrency {c.concurrency}; {cfg.model} ({_dtype(cfg)})"),
        "rates": rates, "slo_s": cfg.slo_s, "rounds": cfg.rounds, "results": results, "unavailable": unavailable,
    }
    summary["check"] = check(results, rates)
    return summary


def check(results: dict, rates: list[float]) -> dict:
    """kvtier-shared's goodput against prefix cache alone's: met, MISSED, or
    not judged (met None) with the reason, and the figures."""
    ours, base = results.get(OURS), results.get(BASE)
    out: dict = {"bar": BAR, "ours": OURS, "base": BASE, "met": None, "ratio": None}
    if not ours or not base:
        out["why"] = f"needs both {OURS} and {BASE} in --configs"
        return out
    g_ours, g_base = ours["goodput_rate"], base["goodput_rate"]
    out.update(ours_rate=g_ours, base_rate=g_base, base_knee=base["knee_rate"])
    if base["knee_rate"] is None:
        out["why"] = f"{BASE} held the SLO at every rate: its goodput is {rates[-1]:g}/s or more; add higher --rates"
    elif g_base is None:
        if g_ours is not None and g_ours >= BAR * rates[0]:
            out.update(met=True, why=f"{BASE} missed at every rate (under {rates[0]:g}/s), {OURS} held to {g_ours:g}/s")
        else:
            out["why"] = f"{BASE} missed the SLO at the lowest rate; add lower --rates"
    else:
        out["ratio"] = (g_ours or 0.0) / g_base
        out["met"] = out["ratio"] >= BAR
    return out


# ------------------------------------------------------------------ report
def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _rate(x) -> str:
    return "none" if x is None else f"{x:g}/s"


def format_table(s: dict) -> str:
    slo = s["slo_s"]
    lines = [f"kvtier bench resume: {s['description']}; {s['rounds']} round(s), ABBA", "",
             f"TTFT from the turn being ready to its first token (queueing included); SLO: p95 <= {slo:g} s", ""]
    head = (f"{'configuration':<18}{'rate/s':>8}{'p50':>9}{'p95':>9}{'p99':>9}{'engine p95':>12}"
            f"{'sess/s':>8}{'req/s':>8}{'SLO':>6}")
    lines += [head, "-" * len(head)]
    for name, v in s["results"].items():
        for rate in s["rates"]:
            f = v["rates"][phase_name(rate)]
            lines.append(f"{name:<18}{rate:>8g}{_f(f.get('ttft_p50_s')):>9}{_f(f.get('ttft_p95_s')):>9}"
                         f"{_f(f.get('ttft_p99_s')):>9}{_f(f.get('engine_ttft_p95_s')):>12}"
                         f"{_f(f.get('sessions_per_s')):>8}{_f(f.get('requests_per_s')):>8}"
                         f"{'met' if f['meets_slo'] else 'miss':>6}")
    lines += ["", f"goodput at TTFT p95 <= {slo:g} s (highest rate held, every lower one held too) and knee "
                  "(first rate missed):"]
    for name, v in s["results"].items():
        done = _f(v["goodput_sessions_per_s"])
        lines.append(f"  {name:<18} goodput {_rate(v['goodput_rate']):>8}  knee {_rate(v['knee_rate']):>8}"
                     f"  (sessions completed/s at the goodput rate: {done})")
    if s.get("unavailable"):
        lines += ["", "not run on this host:"] + [f"  {n}: {why}" for n, why in s["unavailable"].items()]
    c = s["check"]
    lines += ["", "acceptance bar:"]
    verdict = {True: "met", False: "MISSED", None: "not judged"}[c["met"]]
    figures = (f"{c['ours']} {_rate(c.get('ours_rate'))} vs {c['base']} {_rate(c.get('base_rate'))} "
               f"(knee {_rate(c.get('base_knee'))})") if "ours_rate" in c else ""
    ratio = f" = {c['ratio']:.2f}x" if c["ratio"] is not None else ""
    why = f": {c['why']}" if c.get("why") else ""
    lines.append(f"  {c['ours']} goodput >= {c['bar']:g} x {c['base']}'s at TTFT p95 <= {slo:g} s: "
                 f"{figures}{ratio} {verdict}{why}")
    return "\n".join(lines)


def write_report(s: dict, out_dir: Path) -> list[Path]:
    return write_summary(s, out_dir, "goodput", format_table(s)) + _plot(s, out_dir)


def _plot(s: dict, out_dir: Path) -> list[Path]:
    """TTFT p95 against the arrival rate per configuration, with the SLO."""
    plt = pyplot()
    if plt is None:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rates = s["rates"]
    for name, v in s["results"].items():
        ys = [v["rates"][phase_name(r)].get("ttft_p95_s") for r in rates]
        ax.plot(rates, [y if y is not None else float("nan") for y in ys], marker="o", label=name)
    ax.axhline(s["slo_s"], linestyle="--", color="grey", label=f"SLO {s['slo_s']:g} s")
    ax.set(xlabel="conversations started per second", ylabel="TTFT p95 (s, queueing included)",
           xscale="log", yscale="log", title="W2 goodput: TTFT p95 vs arrival rate")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "goodput.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
