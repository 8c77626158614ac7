"""A synthetic ``kvtier bench resume`` run (requests.jsonl + results.json)
whose measurements come from a known ground truth, not from the simulator:
W1's design (every resumed session was evicted by the engine, so the
configuration's tier serves all its usable blocks) and a prefill law with
noise."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvtier.bench.workloads import w1
from kvtier.plan.synth import from_workload

A, B, C = 1.5e-3, 3e-7, 0.02  # the engine's true prefill law
TIER = {"kvtier-memory": "memory", "kvtier-disk": "disk", "kvtier-shared": "shared"}
LATENCY = {"memory": 0.002, "disk": 0.03, "shared": 0.05}  # what a hit adds beyond its prefill
CONFIGS = ("recompute", "prefix-cache", "kvtier-memory", "kvtier-disk", "kvtier-shared")


def prefill(n: int, cached: int = 0) -> float:
    return A * (n - cached) + B * (n * n - cached * cached) + C


def make_run(out: Path, contexts=(512, 1024), sessions: int = 3, seed: int = 0, ttft_scale: float = 1.0,
             hit_error: int = 0) -> Path:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with open(out / "requests.jsonl", "w") as f:
        for ctx in contexts:
            w = w1(sessions, ctx, vocab=512, seed=seed)
            usable = (ctx - 1) // 128 * 128
            for config in CONFIGS:
                t, ttfts, hits = 0.0, [], 0
                for rec in from_workload(w, block_tokens=256, config=config):
                    resumed = rec["phase"] == "resume" and config in TIER
                    cached = usable if resumed else 0
                    ttft = (prefill(ctx, cached) + (LATENCY[TIER[config]] if resumed else 0.0)) * rng.uniform(0.97, 1.03) * ttft_scale
                    rec.update(workload="W1", case=str(ctx), round=0, model="tiny-llama", t_send=t, t_ready=t,
                               t_first=t + ttft, t_done=t + ttft + 0.001, ttft_s=ttft, queue_s=0.0,
                               cached_tokens=cached, output_tokens=1, output=[7])
                    f.write(json.dumps(rec) + "\n")
                    t += ttft + 0.01
                    hits += cached
                    if rec["phase"] == "resume":
                        ttfts.append(ttft)
                ttfts.sort()
                results.setdefault(str(ctx), {})[config] = {
                    "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_s": ttfts,
                    "hit_tokens": {TIER[config]: hits + hit_error} if config in TIER else {},
                }
    (out / "results.json").write_text(json.dumps({
        "workload": "W1", "description": f"W1 long-context cold resume, {sessions} sessions per context",
        "model": "tiny-llama", "contexts": list(contexts), "results": results, "fio": {}}))
    return out
