"""``kvtier plan --sweep``: TTFT at each number of sessions returning at once.

Each session resumes a context of ``--context`` tokens: the engine's
external hit covers its whole blocks but the one holding the last token
(``(context - 1) // block * block`` tokens), the load reads the chunks that
hold them, and the engine computes the rest over the loaded context. The
burst model is ``kvtier.plan.concurrency``.
"""

from __future__ import annotations

import json

from kvtier.errors import ConfigError
from kvtier.plan import concurrency

DEFAULT_LEVELS = (1, 8, 16, 32)
DEFAULT_CONTEXT = 8192


def session_shape(context: int, block: int, chunk: int, bytes_per_token: int) -> tuple[int, int]:
    """(tokens the tier serves, bytes one load reads) for a resume of ``context`` tokens."""
    cached = (context - 1) // block * block
    return cached, -(-cached // chunk) * chunk * bytes_per_token


def plan(args) -> dict:
    """The prediction for the flags of ``kvtier plan --sweep``."""
    from kvtier.plan.flags import step_overhead, time_model

    levels = tuple(args.concurrency or DEFAULT_LEVELS)
    if min(levels) < 1:
        raise ConfigError("--concurrency", f"levels must be positive, got {','.join(map(str, levels))}",
                          "pass e.g. --concurrency 1,8,16")
    context = args.context or DEFAULT_CONTEXT
    if context < 2:
        raise ConfigError("--context", f"a resume needs at least 2 tokens, got {context}", "pass e.g. --context 8192")
    if args.chunk_tokens % args.block_tokens:
        raise ConfigError("--chunk-tokens", f"{args.chunk_tokens} is not a multiple of --block-tokens {args.block_tokens}",
                          "use a multiple of the engine's block size, e.g. 256 with blocks of 128")
    model, prefill, io = time_model(args)
    cached, nbytes = session_shape(context, args.block_tokens, args.chunk_tokens, model.bytes_per_token)
    if cached <= 0:
        raise ConfigError("--context", f"{context} tokens fill no whole block of {args.block_tokens}: nothing to load",
                          f"pass a context longer than --block-tokens ({args.block_tokens})")
    if args.read_rate:
        rates, rate_from = concurrency.parse_rates(args.read_rate), "--read-rate"
    else:
        rates, rate_from = {0: io["shared"].gbps}, "the shared tier's bandwidth (--shared-gbps, --storage-json)"
    if args.engine_s is not None:
        if args.engine_s <= 0:
            raise ConfigError("--engine-s", f"must be positive, got {args.engine_s}",
                              "pass the TTFT of a resume whose KV is already in the engine, in seconds")
        engine_s, engine_from = args.engine_s, "--engine-s"
    else:
        engine_s, engine_from = prefill.seconds(context, cached), f"the prefill law ({prefill.source})"
    latency = args.load_latency_ms / 1000 if args.load_latency_ms is not None else io["shared"].latency_s
    if latency < 0:
        raise ConfigError("--load-latency-ms", f"must be 0 or more, got {args.load_latency_ms}", "pass e.g. 40")
    overhead = step_overhead(args, prefill)
    steps = "batched" if args.engine_steps in (None, "auto") else args.engine_steps
    rows = [concurrency.predict(concurrency.Burst(c, nbytes, concurrency.rate_at(rates, c), latency, engine_s,
                                                  overhead, steps)) for c in levels]
    return {"model": model.name, "context": context, "cached_tokens": cached, "bytes_per_session": nbytes,
            "read_rate_from": rate_from, "load_latency_s": latency, "engine_s": engine_s, "engine_s_from": engine_from,
            "step_overhead_s": min(overhead, engine_s), "engine_steps": steps, "levels": rows}


def format_table(p: dict) -> str:
    lines = [
        f"{p['model']}: sessions of {p['context']} tokens resume {p['cached_tokens']} from the tier "
        f"({p['bytes_per_session'] / (1 << 20):.1f} MiB per load) and compute {p['context'] - p['cached_tokens']}",
        f"tier: read rate from {p['read_rate_from']}; {p['load_latency_s'] * 1000:.0f} ms per load",
        f"engine: S = {p['engine_s']:.3f} s per resume from {p['engine_s_from']}; "
        f"{p['step_overhead_s'] * 1000:.0f} ms per step; steps {p['engine_steps']}", "",
        f"{'sessions':>8}{'read GB/s':>11}{'load s':>9}{'loads done s':>14}{'TTFT p50':>10}{'p90':>9}{'p99':>9}  bound by",
    ]
    lines.append("-" * len(lines[-1]))
    for r in p["levels"]:
        lines.append(f"{r['sessions']:>8}{r['read_gbps']:>11.2f}{r['load_s']:>9.3f}{r['loads_done_s']:>14.3f}"
                     f"{r['ttft_p50_s']:>10.2f}{r['ttft_p90_s']:>9.2f}{r['ttft_p99_s']:>9.2f}  {r['bound']}")
    lines += ["", "load s: one session's bytes at the level's aggregate rate; bound by: the stage slower per session "
              "(tier: load s > S; engine: S >= load s)"]
    return "\n".join(lines)


def main(args) -> int:
    p = plan(args)
    print(json.dumps(p, indent=2) if args.json else format_table(p))
    return 0
