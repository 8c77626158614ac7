"""``kvtier plan``: the parser (``register``) and its handler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier import argtypes, progress
from kvtier.errors import ConfigError

DESCRIPTION = """\
Capacity planning from request traces: replays a trace through a model of the
engine's prefix cache and of kvtier's tiers (kvtier's own eviction policies,
as a tier's `eviction` key names them: memory and disk LRU and the shared
tier's watermark collector unless --*-eviction says otherwise; promotion
into memory on a lower-tier hit, write-through of new chunks to every tier) and
predicts, per tier, the hit ratio, the read and write bandwidth, time to
first token (p50/p90/p99) and prefill throughput against recompute, hit ratio
against capacity curves with their knee, and recommended capacities.

inputs:
  TRACE            JSON Lines, one request per line, format detected:
                   - Mooncake FAST'25: timestamp (ms), input_length, output_length,
                     hash_ids (512-token blocks)
                   - Alibaba Bailian: chat_id, parent_chat_id, timestamp (s), input_length,
                     output_length, turn, hash_ids (16-token blocks)
                   - kvtier: requests.jsonl of `kvtier bench resume` (driver records)
  --synth          a synthetic multi-turn trace instead (--sessions, --turns, ...)
  capacities       --engine-kv or --engine-tokens, --memory, --disk, --shared
                   (a tier left out is not simulated); sizes like 64GiB, 2TB
  bandwidths       --storage-json (from `kvtier bench storage --json`) or --*-gbps
  prefill model    --calibrate (a `kvtier bench resume` results dir/file), or --prefill a,b,c

outputs (--out DIR): report.md (for purchasing), summary.json, plan-hit_ratio.png
  and plan-ttft_cdf.png (when matplotlib is installed); the table is printed.

--validate RESULTS_DIR replays the request log of a `kvtier bench resume` run
(RESULTS_DIR/requests.jsonl) with the configuration it ran and compares
per-tier hit ratios (must be equal) and TTFT p50 (within 15%) with what it
measured; exit status 1 when a bound is missed.

--sweep predicts TTFT p50/p90/p99 when --concurrency sessions of --context
tokens return at once (no trace): each load pays --load-latency-ms and shares
the tier's --read-rate (one rate, or a rate per number of streams as fio
measures it); the k-th load ends at lat + k*B/R. The engine computes the
suffixes in steps: S (--engine-s: a resume whose KV is already in the engine;
default the prefill law's) per suffix, --step-overhead-ms (default the law's
constant) once per step.
--engine-steps batched: every finished load joins the next step (vLLM's
scheduler); staggered: one finished load per step (k-th first token at about
L + k*S). On the directory of a `kvtier bench resume --concurrency` run
(it holds sweep.json), --validate predicts every kvtier configuration and
level from the run's fio rates, bytes read and engine phase, the step policy
from its bursts (--engine-steps auto), and compares TTFT p50 (within 20%).
"""

EXAMPLE = """\
examples:
  kvtier plan tests/plan/data/bailian_sample.jsonl --model llama-3.1-8b \\
      --engine-kv 16GiB --memory 64GiB --disk 1TiB --shared 8TiB --instances 4 --out plan/
  kvtier plan --synth --sessions 5000 --write-trace chat.jsonl --memory 32GiB --disk 512GiB
  kvtier plan --validate results/resume-w2
  kvtier plan --sweep --model qwen2.5-7b --context 8192 --concurrency 1,8,16,32 \\
      --read-rate 1:8.2,8:6.6,32:6.5 --engine-s 0.9
  kvtier plan --validate results/sweep-w1
"""


def register(subparsers) -> None:
    """``kvtier plan``."""
    p = subparsers.add_parser(
        "plan", help="capacity planning: replay a trace through kvtier's tiers, predict hit ratios, TTFT, what to buy",
        description=DESCRIPTION, epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", help="trace file (JSON Lines: Mooncake, Bailian or kvtier format)")
    g = p.add_argument_group("trace")
    g.add_argument("--format", default="auto", help="auto (default), mooncake, bailian, kvtier")
    g.add_argument("--trace-block-tokens", type=int, help="tokens per hash id (default: 512 Mooncake, 16 Bailian)")
    g.add_argument("--limit", type=int, help="replay only the first N requests")
    g.add_argument("--config", help="configuration of a kvtier log to replay (default: the first)")
    g.add_argument("--synth", action="store_true", help="a synthetic multi-turn trace instead of TRACE")
    g.add_argument("--sessions", type=int, default=200, help="synthetic: sessions (default 200)")
    g.add_argument("--turns", type=argtypes.pair, default=(1, 8), help="synthetic: turns per session LO,HI (default 1,8)")
    g.add_argument("--system-prompts", type=int, default=4, help="synthetic: distinct shared system prompts (default 4)")
    g.add_argument("--system-tokens", type=int, default=2048, help="synthetic: system prompt tokens (default 2048)")
    g.add_argument("--user-tokens", type=argtypes.pair, default=(64, 1024), help="synthetic: user turn tokens LO,HI (default 64,1024)")
    g.add_argument("--answer-tokens", type=argtypes.pair, default=(32, 512), help="synthetic: answer tokens LO,HI (default 32,512)")
    g.add_argument("--think-s", type=float, default=30.0, help="synthetic: mean pause between turns (default 30 s)")
    g.add_argument("--arrival-rate", type=float, default=1.0, help="synthetic: new sessions per second (default 1)")
    g.add_argument("--write-trace", help="synthetic: also write the trace here (Bailian format)")

    g = p.add_argument_group("engine and tiers")
    g.add_argument("--model", default="llama-3.1-8b", help="KV shape preset (default llama-3.1-8b): qwen2.5-0.5b, "
                   "qwen2.5-7b, llama-3.1-8b, llama-3.1-70b, qwen3-coder-480b")
    g.add_argument("--chunk-tokens", type=int, default=256, help="kvtier chunk size (default 256)")
    g.add_argument("--block-tokens", type=int, default=128, help="engine KV block size (default 128: vLLM on CPU; 16 on most GPUs)")
    g.add_argument("--engine-kv", type=argtypes.size, help="engine KV cache per instance in bytes (sets its prefix cache size)")
    g.add_argument("--engine-tokens", type=int, help="engine KV cache per instance in tokens (instead of --engine-kv)")
    g.add_argument("--memory", type=argtypes.size, help="memory tier per instance, e.g. 64GiB")
    g.add_argument("--disk", type=argtypes.size, help="local disk tier per instance, e.g. 2TiB")
    g.add_argument("--shared", type=argtypes.size, help="shared tier (one for all instances), e.g. 20TiB")
    g.add_argument("--storage-json", help="bandwidths from `kvtier bench storage --json`")
    for t, bw, lat in (("memory", 10.7, 0.2), ("disk", 1.6, 40), ("shared", 1.6, 40)):
        g.add_argument(f"--{t}-gbps", type=float, help=f"{t} tier read bandwidth per instance, GB/s (default {bw})")
        g.add_argument(f"--{t}-latency-ms", type=float, help=f"{t} tier latency per load, ms (default {lat}; "
                       "disk and shared include the connector's asynchronous load steps)")
    for t, default in (("memory", "lru"), ("disk", "lru"), ("shared", "watermark")):
        g.add_argument(f"--{t}-eviction", metavar="POLICY", help=f"{t} tier eviction policy, as its config's "
                       f"`eviction` key names it (default {default}; lru, lfu, watermark where the tier has it)")
    g.add_argument("--high-watermark", type=float, default=0.95, help="shared tier collector start (default 0.95)")
    g.add_argument("--low-watermark", type=float, default=0.85, help="shared tier collector target (default 0.85)")
    g.add_argument("--touch-interval-s", type=float, default=60.0, help="shared tier access stamp interval (default 60)")
    g.add_argument("--gc-interval-s", type=float, default=60.0, help="shared tier collection interval (default 60)")
    g.add_argument("--no-promote", action="store_true", help="do not keep lower-tier hits in memory")
    g.add_argument("--instances", type=int, default=1, help="engine instances (default 1)")
    g.add_argument("--routing", default="sticky", help="sticky (by session, default), random, trace (the log's instance)")
    g.add_argument("--seed", type=int, default=0, help="routing and synthetic trace seed")

    g = p.add_argument_group("time model")
    g.add_argument("--calibrate", help="a kvtier bench resume run (its dir, requests.jsonl or results.json): "
                   "fit the prefill model to its recompute TTFTs and each tier's latency to its hits")
    g.add_argument("--prefill", help="prefill model a,b,c: seconds = a*n + b*n^2 + c")
    g.add_argument("--copy-gbps", type=float, help="copy of loaded chunks into engine blocks, GB/s (default 8)")
    g.add_argument("--decode-ms-per-token", type=float, default=0.0,
                   help="time a request keeps its engine blocks per output token after its prefill (default 0)")

    g = p.add_argument_group("sessions returning at once (--sweep, and --validate of a sweep run)")
    g.add_argument("--sweep", action="store_true", help="predict TTFT at each --concurrency level instead of replaying a trace")
    g.add_argument("--concurrency", type=argtypes.ints, metavar="N[,N...]",
                   help="sessions returning at once, one burst per level (default 1,8,16,32)")
    g.add_argument("--context", type=int, help="tokens of each session's prompt at its resume (default 8192)")
    g.add_argument("--read-rate", metavar="RATE", help="the tier's aggregate read rate: one for every level (2GB/s, "
                   "1.5GiB/s, 800MB/s) or per number of streams as fio measures it (1:8.2,8:6.6,16:6.5: GB/s; a level "
                   "takes the rate at the most streams not above it). Default: --shared-gbps; on --validate the run's fio")
    g.add_argument("--engine-s", type=float, metavar="SECONDS", help="the engine's own resume: TTFT with the KV "
                   "already in the engine (the sweep's engine phase). Default: the prefill law's suffix; on --validate "
                   "the run's engine phase")
    g.add_argument("--engine-steps", choices=("auto", "batched", "staggered"), default="auto",
                   help="which finished loads each engine step computes: batched (all of them), staggered (one); "
                   "auto (default): --validate reads it from the run's bursts, --sweep takes batched")
    g.add_argument("--step-overhead-ms", type=float, help="an engine step's fixed cost, paid once per step however "
                   "many suffixes it computes (default: the prefill law's constant c; on a GPU, a step's launch cost)")
    g.add_argument("--load-latency-ms", type=float, help="fixed cost of each load beyond its bytes (default "
                   "--shared-latency-ms: 40, or as --calibrate fits it)")

    g = p.add_argument_group("output")
    g.add_argument("--out", help="write report.md, summary.json and plots here")
    g.add_argument("--json", action="store_true", help="print the summary as JSON")
    g.add_argument("--curve-sample", default="auto", help="fraction of keys the capacity curves follow "
                   "(auto: all up to 50k requests, then fewer; 0: no curves)")
    g.add_argument("--validate", metavar="RESULTS_DIR", help="replay a kvtier bench resume run and compare; on a "
                   "--concurrency sweep run, predict each level's bursts and compare")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=handle)


def build_config(args, trace_units: int):
    from kvtier.plan import cost
    from kvtier.plan.flags import time_model
    from kvtier.plan.sim import PlanConfig, TierPlan
    from kvtier.tiers.eviction import check
    from kvtier.tiers.registry import config_class

    model, prefill, io = time_model(args)
    tiers = []
    for t in ("memory", "disk", "shared"):
        cap = getattr(args, t)
        eviction = getattr(args, f"{t}_eviction", None) or ""
        if eviction:  # refused as the tier's config refuses it
            check(eviction, config_class(t), f"--{t}-eviction")
        if cap:
            tiers.append(TierPlan(t, cap, io[t], args.high_watermark, args.low_watermark, args.touch_interval_s,
                                  args.gc_interval_s, eviction))
    bpt = model.bytes_per_token
    engine_blocks = None
    if args.engine_tokens:
        engine_blocks = args.engine_tokens // args.block_tokens
    elif args.engine_kv:
        engine_blocks = args.engine_kv // (bpt * args.block_tokens)
    if args.routing not in ("sticky", "random", "trace"):
        raise ConfigError("--routing", f"unknown routing {args.routing!r}", "use sticky, random or trace")
    if args.chunk_tokens % args.block_tokens:
        raise ConfigError("--chunk-tokens", f"{args.chunk_tokens} is not a multiple of --block-tokens {args.block_tokens}",
                          "use a multiple of the engine's block size, e.g. 256 with blocks of 128")
    return PlanConfig(model=model, tiers=tuple(tiers), chunk_tokens=args.chunk_tokens, block_tokens=args.block_tokens,
                      engine_blocks=engine_blocks, instances=args.instances, routing=args.routing, seed=args.seed,
                      prefill=prefill, copy_gbps=args.copy_gbps or cost.DEFAULT_COPY_GBPS,
                      decode_s_per_token=args.decode_ms_per_token / 1000,
                      promote=not args.no_promote)


def _trace(args):
    from kvtier.plan import loaders, synth
    from kvtier.plan.traces import Trace

    if args.synth:
        shape = synth.SynthShape(args.sessions, args.turns, args.system_prompts, args.system_tokens, args.user_tokens,
                                 args.answer_tokens, args.think_s, args.arrival_rate, args.seed)
        records = synth.synth(shape)
        if args.write_trace:
            synth.write_jsonl(records, args.write_trace)
            print(f"wrote {args.write_trace} ({len(records)} requests)", file=sys.stderr)
        reqs = list(loaders._bailian(iter(records), 16, args.block_tokens))
        return Trace.of(f"synthetic ({args.sessions} sessions)", args.block_tokens, reqs, format="synthetic",
                        shape=synth.shape_json(shape))
    if not args.trace:
        raise ConfigError("trace", "no trace given", "pass a trace file, --synth, or --validate RESULTS_DIR")
    return loaders.load(args.trace, args.format, args.block_tokens, args.trace_block_tokens, args.limit, args.config)


SWEEP_FLAGS = ("concurrency", "context", "read_rate", "engine_s", "step_overhead_ms", "load_latency_ms")


def handle(args: argparse.Namespace) -> int:
    sweep_run = None
    if args.validate:
        from kvtier.plan import sweepcheck

        sweep_run = sweepcheck.find(Path(args.validate))
        if sweep_run:
            if args.load_latency_ms is None and args.shared_latency_ms is not None:
                args.load_latency_ms = args.shared_latency_ms
            return sweepcheck.main(args, sweep_run)
    if not args.sweep:
        given = [f for f in SWEEP_FLAGS if getattr(args, f) is not None] + (
            ["engine_steps"] if args.engine_steps != "auto" else [])
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(flag, "applies only to sessions returning at once",
                              "add --sweep, or pass --validate the directory of a kvtier bench resume --concurrency run")
    if args.validate:
        from kvtier.plan import validate

        return validate.main(args)
    if args.sweep:
        from kvtier.plan import sweepplan

        if args.trace or args.synth:
            raise ConfigError("--sweep", "predicts bursts of sessions, not a trace", "drop the trace (or --synth), or drop --sweep")
        if args.load_latency_ms is None and args.shared_latency_ms is not None:
            args.load_latency_ms = args.shared_latency_ms
        return sweepplan.main(args)
    from dataclasses import replace

    from kvtier.plan import report
    from kvtier.plan.sim import Simulator

    trace = _trace(args)
    cfg = build_config(args, trace.unit_tokens)
    if not cfg.tiers and not cfg.engine_blocks:
        raise ConfigError("--memory", "nothing to simulate", "give at least one of --engine-kv, --memory, --disk, --shared")
    if args.curve_sample == "auto":
        n = trace.count or 0
        rate = 1.0 if n <= 50_000 else max(0.001, 50_000 / n)
    else:
        rate = float(args.curve_sample)
    cfg = replace(cfg, curve_sample=rate)
    if trace.meta.get("runs", 1) > 1:
        print(f"note: {trace.name} holds {trace.meta['runs']} runs of configuration {trace.meta['config']!r} "
              f"(cases, rounds); replaying the first (case {trace.meta['case']!r})", file=sys.stderr)
    if trace.meta.get("format") == "mooncake" and cfg.routing == "sticky" and cfg.instances > 1:
        print("note: Mooncake traces name no sessions: sticky routing sends every request to a random instance",
              file=sys.stderr)
    bars = progress.bars(not args.no_progress)
    sim = Simulator(cfg).run(trace, bars("replay", trace.count or 0))
    meta = {"name": trace.name, **{k: v for k, v in trace.meta.items() if k in ("format", "block_tokens", "config", "workload", "path")}}
    summary = report.summarise(sim, meta)
    print(json.dumps(summary, indent=2) if args.json else report.format_table(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        pngs = report.plots(summary, sim, out, prefix="plan-")
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "report.md").write_text(report.markdown(summary, [str(p) for p in pngs]))
        print(f"\nwrote {out / 'report.md'}, {out / 'summary.json'}" + "".join(f", {p}" for p in pngs), file=sys.stderr)
    return 0
