"""A synthetic ``kvtier bench resume --concurrency`` run (report/sweep.json +
report/requests.jsonl) whose bursts follow a known engine, written in closed
form, not by the planner's model: loads far faster than the engine, so

    batched    the first session alone in a step (its load ended first),
               the other c-1 in the next one: T = L + S, then L + S + o + (c-1)(S-o)
    staggered  one session per step: T_k = L + k*S

with L = LATENCY + B/R_c, each TTFT with a few % of noise."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvtier.bench.resume_report import pct

CONTEXT, CACHED, BPT = 2048, 1920, 12288   # qwen2.5-0.5b
BYTES = CONTEXT * BPT                      # the chunks a load reads
FIO = {1: 8.0, 4: 6.5, 8: 6.5}             # GB/s by streams
ENGINE_S, OVERHEAD, LATENCY = 0.5, 0.02, 0.04
RECOMPUTE_S = 0.003564 * CONTEXT + OVERHEAD


def burst(c: int, steps: str, engine_s: float) -> list[float]:
    first = LATENCY + BYTES / (FIO[c] * 1e9) + engine_s
    if steps == "staggered":
        return [first + k * engine_s for k in range(c)]
    return [first] + [first + OVERHEAD + (c - 1) * (engine_s - OVERHEAD)] * (c - 1)


def make_sweep(out: Path, steps: str = "batched", burst_scale: float = 1.0, levels=(1, 4, 8), seed: int = 0,
               fio: bool = True) -> Path:
    """``burst_scale``: the engine in the bursts that much slower than its engine phase says."""
    rng = random.Random(seed)
    rep = out / "report"
    rep.mkdir(parents=True, exist_ok=True)
    recs, results = [], {}
    for config in ("recompute", "prefix-cache", "kvtier-shared"):
        per = {}
        for c in levels:
            if config == "kvtier-shared":
                ts = [t * rng.uniform(0.98, 1.02) for t in burst(c, steps, ENGINE_S * burst_scale)]
            else:
                ts = [RECOMPUTE_S * (k + 1) for k in range(c)]
            cached = CACHED if config == "kvtier-shared" else 0
            recs += [{"config": config, "case": str(CONTEXT), "round": 0, "phase": f"c{c}", "session": k,
                      "instance": 0, "model": "qwen2.5-0.5b", "prompt_tokens": CONTEXT, "cached_tokens": cached,
                      "output_tokens": 16, "t_send": 0.0, "t_first": t, "ttft_s": t, "t_done": t + 0.1}
                     for k, t in enumerate(ts)]
            per[str(c)] = {"requests": c, "ttft_p50_s": pct(ts, 0.5), "ttft_p90_s": pct(ts, 0.9),
                           "ttft_p99_s": pct(ts, 0.99), "read_bytes_per_request": BYTES if cached else 0.0}
        engine = ENGINE_S * rng.uniform(0.98, 1.02) if config != "recompute" else RECOMPUTE_S
        recs.append({"config": config, "case": str(CONTEXT), "round": 0, "phase": "engine", "session": 0,
                     "instance": 0, "model": "qwen2.5-0.5b", "prompt_tokens": CONTEXT,
                     "cached_tokens": CACHED if config != "recompute" else 0, "output_tokens": 16,
                     "t_send": 0.0, "t_first": engine, "ttft_s": engine, "t_done": engine + 0.1})
        results[config] = {"levels": per, "engine_s": engine if config != "recompute" else None}
    device = {"depth": 8, "gbps_by_streams": {str(c): FIO[c] for c in levels} if fio else {},
              "best_gbps": max(FIO.values()) if fio else None}
    (rep / "sweep.json").write_text(json.dumps({
        "kind": "sweep", "description": f"synthetic sweep, {steps} engine", "model": "qwen2.5-0.5b",
        "levels": list(levels), "device": device, "results": {str(CONTEXT): results}}))
    (rep / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out
