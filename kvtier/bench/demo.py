"""``kvtier demo``: a short cold-resume run of a real engine on this machine.

One vLLM engine (CPU build), a model built on the spot (Qwen2.5-0.5B shape,
dummy weights), kvtier with all three tiers on a local directory. Several
sessions together larger than the engine's KV capacity are prefilled, then
resumed in the same order, so the engine has evicted each one by the time it
returns. Phases, in one process:

1. warm            every session once (kvtier saves their KV)
2. hit: memory     resume; served from the memory tier
3. hit: disk       memory tier emptied; served from the disk tier
4. hit: shared     memory and disk emptied, page cache dropped; cold reads
                   from the shared-directory tier
5. recompute       new sessions of the same length: full prefill

TTFT is the wall time of one request with ``max_tokens=1`` (prefill plus
the first token), measured one session at a time.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.bench.engine_env import engine_env
from kvtier.bench.tinymodels import PRESETS, build_config_only


def build_spec(workdir: Path, preset: str, sessions: int, tokens: int, seed: int = 0) -> dict:
    model = build_config_only(preset, workdir / "models" / preset, max_len=tokens + 256)
    vocab = PRESETS[preset][6]
    rng = random.Random(seed)

    def session() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(tokens)]

    old = [session() for _ in range(sessions)]
    new = [session() for _ in range(sessions)]
    bs = 128
    blocks_per_session = -(-(tokens + 8) // bs)
    # Room for about 1.5 sessions: every resume finds its session evicted.
    engine_blocks = blocks_per_session * 3 // 2 + 1
    kvtier = {
        "chunk_tokens": 256,
        "tiers": [
            {"kind": "memory", "capacity": "2GiB"},
            {"kind": "disk", "path": str(workdir / "disk"), "capacity": "8GiB"},
            {"kind": "shared", "path": str(workdir / "shared"), "capacity": "16GiB"},
        ],
    }
    prompts = [{"tokens": t} for t in old]
    return {
        "model": str(model),
        "kvtier": kvtier,
        "engine": {
            "load_format": "dummy", "dtype": "bfloat16", "max_model_len": tokens + 256,
            "num_gpu_blocks_override": engine_blocks, "kv_cache_memory_bytes": 2 << 30,
        },
        "phases": [
            {"name": "warm", "prompts": prompts, "max_tokens": 1},
            {"name": "hit: memory", "prompts": prompts, "max_tokens": 1},
            {"name": "hit: disk", "prompts": prompts, "max_tokens": 1, "drop_tiers": ["memory"]},
            {"name": "hit: shared (cold)", "prompts": prompts, "max_tokens": 1,
             "drop_tiers": ["memory", "disk"], "drop_page_cache": True},
            {"name": "recompute", "prompts": [{"tokens": t} for t in new], "max_tokens": 1},
        ],
    }


def run(workdir: Path, preset: str = "qwen2.5-0.5b", sessions: int = 4, tokens: int = 2048,
        timeout_s: float = 1200, log=print) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = build_spec(workdir, preset, sessions, tokens)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        engine_log = workdir / "engine.log"
        log(f"running one vLLM engine ({preset}, dummy weights, {sessions} sessions x {tokens} tokens); "
            f"engine log: {engine_log}")
        with open(engine_log, "w") as f:
            proc = subprocess.run([sys.executable, "-m", "kvtier.bench.vllm_runner", str(spec_path), str(out_path)],
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, env=engine_env())
        if proc.returncode != 0:
            tail = engine_log.read_text()[-3000:]
            raise RuntimeError(f"the engine failed (exit {proc.returncode}); end of its log:\n{tail}")
        out = json.loads(out_path.read_text())
    return summarise(out, tokens)


def summarise(out: dict, tokens: int) -> dict:
    rows = []
    for phase in out["phases"]:
        ttfts = [r["wall_s"] for r in phase["results"]]
        rows.append({
            "phase": phase["name"],
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_s": ttfts,
            "cached_tokens_p50": statistics.median(r["num_cached_tokens"] for r in phase["results"]),
        })
    base = next(r["ttft_p50_s"] for r in rows if r["phase"] == "recompute")
    for r in rows:
        r["speedup_vs_recompute"] = base / r["ttft_p50_s"] if r["ttft_p50_s"] > 0 else float("inf")
    return {"session_tokens": tokens, "rows": rows, "vllm_metrics": out.get("metrics", {}),
            "kvtier_metrics": out.get("kvtier_metrics", {})}


def format_table(summary: dict) -> str:
    lines = [
        f"kvtier demo: resume of {summary['session_tokens']}-token sessions evicted by the engine",
        "",
        f"{'phase':<22}{'TTFT p50':>10}{'cached tokens':>15}{'vs recompute':>14}",
        "-" * 61,
    ]
    for r in summary["rows"]:
        lines.append(
            f"{r['phase']:<22}{r['ttft_p50_s']:>9.3f}s{r['cached_tokens_p50']:>15.0f}{r['speedup_vs_recompute']:>13.1f}x"
        )
    hits = {k: v for k, v in summary["kvtier_metrics"].items() if k.startswith("kvtier_vllm_external_hit_tokens")}
    ext = summary["vllm_metrics"].get("vllm:external_prefix_cache_hits")
    lines += ["", f"vLLM external prefix-cache hits: {ext:.0f} tokens; kvtier by tier: "
              + ", ".join(f"{k.split('tier=')[1].rstrip('}')}={v:.0f}" for k, v in sorted(hits.items()))]
    return "\n".join(lines)
