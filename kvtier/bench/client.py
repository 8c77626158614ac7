"""``kvtier bench client``: a published benchmark client (GuideLLM) drives
``kvtier serve`` and plain vLLM with the same multi-turn workload, one
server after the other, and one table compares them.

Like for like: both servers are started by ``kvtier serve`` with the same
model directory, vLLM arguments, environment and process mode; the
baseline with ``--no-kvtier`` (the same vLLM command without the
connector). vLLM's own prefix cache is on for both, so kvtier's figures
are what it adds beyond it. Each side gets a fresh kvtier store (the
second run must not find what the first stored) and GuideLLM the same
seed, so both see the same prompts.

Thread ownership: everything runs on the caller's thread; each server and
each GuideLLM run is a child process that this module starts, waits for
and stops (the server with SIGTERM, which ``kvtier serve`` forwards, then
SIGKILL).

Writes ``DIR/results.json`` (settings, commands, per-side figures and
metric deltas, ratios), ``DIR/<side>/guidellm.json`` (GuideLLM's own
report) and ``DIR/logs/``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench import client_guidellm as guidellm
from kvtier.errors import ConfigError

SIDES = ("vllm", "kvtier")  # run in this order; the baseline first
MODEL_NAME = "bench"        # --served-model-name of both servers
BLOCK_TOKENS = 128          # vLLM's KV block on CPU
PROCESS_MODES = ("multiprocess", "single")


@dataclass(frozen=True)
class ClientBenchConfig:
    workdir: Path
    model: str = "qwen2.5-0.5b"
    workload: guidellm.Workload = field(default_factory=guidellm.Workload)
    dtype: str = "auto"
    processes: str = "multiprocess"    # vLLM's default (API server, engine core, worker) or "single"
    kv_blocks: int | None = None       # engine KV blocks (default: see kv_blocks_for)
    kvtier_config: Path | None = None  # default: memory + disk tiers of the run's own
    guidellm: str = "guidellm"         # the command
    start_timeout_s: float = 600.0
    run_timeout_s: float = 3600.0

    def validate(self) -> None:
        from kvtier.bench.tinymodels import PRESETS

        if self.model not in PRESETS:
            raise ConfigError("--model", f"unknown model preset {self.model!r}", f"use one of: {', '.join(PRESETS)}")
        self.workload.validate()
        if self.processes not in PROCESS_MODES:
            raise ConfigError("--processes", f"unknown mode {self.processes!r}", f"use {' or '.join(PROCESS_MODES)}")
        if self.kv_blocks is not None and self.kv_blocks < self.min_kv_blocks():
            raise ConfigError("--kv-blocks", f"{self.kv_blocks} blocks of {BLOCK_TOKENS} tokens cannot hold one "
                              f"conversation's longest prompt ({self.max_model_len()} tokens with its answer)",
                              f"pass --kv-blocks {self.min_kv_blocks()} or more, or shorten the workload")
        if self.kvtier_config is not None:
            from kvtier.config import load_config

            if not Path(self.kvtier_config).is_file():
                raise ConfigError("--kvtier-config", f"no file {self.kvtier_config}", "give a kvtier config file")
            load_config(str(self.kvtier_config), environ={})

    def max_model_len(self) -> int:
        need = self.workload.longest_prompt() + self.workload.output_tokens
        return -(-need // BLOCK_TOKENS) * BLOCK_TOKENS

    def min_kv_blocks(self) -> int:
        return self.max_model_len() // BLOCK_TOKENS + 1

    def kv_blocks_for(self) -> int:
        """The engine's KV: the longest prompt once per request in flight,
        fewer than the open conversations hold together, so sessions that
        come back after their think time find their prefix evicted."""
        return self.kv_blocks if self.kv_blocks is not None else self.min_kv_blocks() * self.workload.concurrency


# ------------------------------------------------------------------ one side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block_bytes(model: str, dtype: str) -> int:
    from kvtier.bench.tinymodels import PRESETS

    _, layers, hidden, heads, kv_heads, _, _ = PRESETS[model]
    return 2 * layers * kv_heads * (hidden // heads) * BLOCK_TOKENS * (4 if dtype == "float32" else 2)


def vllm_args(cfg: ClientBenchConfig, dtype: str, port: int) -> list[str]:
    """vLLM's arguments, the same for both servers."""
    blocks = cfg.kv_blocks_for()
    kv_bytes = max(64 << 20, 2 * blocks * _block_bytes(cfg.model, dtype))
    return ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
            "--load-format", "dummy", "--dtype", dtype, "--enforce-eager",
            "--max-model-len", str(cfg.max_model_len()), "--kv-cache-memory-bytes", str(kv_bytes),
            "--num-gpu-blocks-override", str(blocks), "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log"]


def server_env(cfg: ClientBenchConfig, tmp: Path) -> dict[str, str]:
    """The environment both servers get: the benchmarks' engine environment
    (tcmalloc and Intel OpenMP preloaded where present, no model hub), the
    chosen process mode, this checkout's kvtier first on the path, and no
    KVTIER_* settings (the kvtier side's config file is its only source)."""
    import kvtier
    from kvtier.bench.engine_env import engine_env

    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    base.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env = engine_env(base)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if cfg.processes == "single":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    root = str(Path(kvtier.__file__).resolve().parents[1])
    env.update(TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")])))
    return env


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    from kvtier.bench.endpoint import EndpointError, http_get

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was ready (log: {log})")
        try:
            http_get(url, "/health", timeout_s=2.0)
            return
        except EndpointError:
            time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s (log: {log})")


def _stop(proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """SIGTERM to ``kvtier serve`` (it stops its server and sweeps what the
    server's processes leave); SIGKILL if it is still there ``timeout_s``
    later (its server then gets SIGTERM from the parent-death signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _settle(url: str, before: dict, expected: int, timeout_s: float = 10.0) -> dict:
    """Scrape ``url`` until vLLM has counted ``expected`` more finished
    requests and kvtier's tiers have written what they were handed (both
    trail the last streamed answer), or ``timeout_s`` passes."""
    from kvtier.bench import endpoint

    end = time.monotonic() + timeout_s
    while True:
        after = endpoint.scrape(url)
        done = endpoint.total(after, endpoint.VLLM_COUNTERS["requests"]) - \
            endpoint.total(before, endpoint.VLLM_COUNTERS["requests"]) >= expected
        if (done and endpoint.writes_settled(before, after)) or time.monotonic() > end:
            return after
        time.sleep(0.2)


def run_side(side: str, cfg: ClientBenchConfig, model_dir: Path, kv_config: Path, dtype: str, log) -> dict:
    """Start one server, run GuideLLM against it, stop the server."""
    from kvtier.bench import endpoint

    work, logs = cfg.workdir / side, cfg.workdir / "logs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    own = ["--config", str(kv_config)] if side == "kvtier" else ["--no-kvtier"]
    serve_argv = [sys.executable, "-m", "kvtier.cli", "serve", str(model_dir), *own, *vllm_args(cfg, dtype, port)]
    tmp = Path(tempfile.mkdtemp(prefix="kvcl-"))  # short: vLLM's IPC socket paths live under it
    server_log = logs / f"{side}-server.log"
    out = {"side": side, "url": url, "server_command": shlex.join(serve_argv), "server_log": str(server_log)}
    t0 = time.monotonic()
    with open(server_log, "wb") as fh:
        proc = subprocess.Popen(serve_argv, env=server_env(cfg, tmp), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        log(f"{side}: starting the server ({cfg.processes} mode; log {server_log})")
        _wait_healthy(url, proc, server_log, cfg.start_timeout_s)
        out["startup_s"] = time.monotonic() - t0
        report = work / "guidellm.json"
        argv = guidellm.command(cfg.guidellm, url, MODEL_NAME, model_dir, cfg.workload, report)
        out["client_command"] = shlex.join(argv)
        log(f"{side}: GuideLLM, {cfg.workload.sessions} sessions x {cfg.workload.turns} turns "
            f"(log {logs / f'{side}-guidellm.log'})")
        before = endpoint.scrape(url)
        genv = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(logs / f"{side}-guidellm.log", "wb") as fh:
            rc = subprocess.run(argv, env=genv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=cfg.run_timeout_s).returncode
        after = _settle(url, before, cfg.workload.requests)
        out["client_status"] = rc
        out["client_wall_s"] = time.monotonic() - t0 - out["startup_s"]
        if rc != 0 or not report.exists():
            raise RuntimeError(f"GuideLLM exited with status {rc} (log: {logs / f'{side}-guidellm.log'})")
        out.update(guidellm.summarise(report))
        d = endpoint.delta(before, after)
        out["server"] = endpoint.summarise_delta(d)
        out["kvtier_hit_tokens"] = sum(out["server"]["kvtier_hit_tokens_by_tier"].values())
    except (RuntimeError, subprocess.TimeoutExpired, endpoint.EndpointError) as exc:
        out["error"] = str(exc)
    finally:
        t1 = time.monotonic()
        _stop(proc)
        out["stop_s"] = time.monotonic() - t1
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------ the comparison


def _default_kv_config(workdir: Path, node_memory: Path) -> Path:
    store = workdir / "store"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    path = workdir / "kvtier.yaml"
    path.write_text(f"node_memory_dir: {node_memory}\n"
                    f"tiers:\n  - kind: memory\n    capacity: 1GiB\n"
                    f"  - kind: disk\n    path: {store}\n    capacity: 4GiB\n")
    return path


def _ratio(a, b):
    return a / b if a is not None and b else None


def compare(sides: dict) -> dict:
    """kvtier's figures over vLLM's (TTFT: below 1 is better; throughput:
    above 1 is better)."""
    k, v = sides.get("kvtier", {}), sides.get("vllm", {})
    out = {f"ttft_{p}": _ratio((k.get("ttft_ms") or {}).get(p), (v.get("ttft_ms") or {}).get(p))
           for p in ("p50", "p90", "p99")}
    out["output_tokens_per_s"] = _ratio(k.get("output_tokens_per_s"), v.get("output_tokens_per_s"))
    out["requests_per_s"] = _ratio(k.get("requests_per_s"), v.get("requests_per_s"))
    return out


def side_ok(side: dict, expected: int) -> bool:
    return "error" not in side and side.get("requests_ok") == expected and not side.get("requests_failed")


def run(cfg: ClientBenchConfig, log=print) -> dict:
    """Both sides, one after the other; the summary written to DIR/results.json."""
    from kvtier.bench.bytetok import write_byte_tokenizer
    from kvtier.bench.tinymodels import PRESETS, build_config_only, resolve_dtype

    cfg.validate()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(cfg.dtype)
    model_dir = build_config_only(cfg.model, cfg.workdir / "model", max_len=cfg.max_model_len(), dtype=dtype)
    write_byte_tokenizer(model_dir, PRESETS[cfg.model][6])
    node_memory = Path(tempfile.mkdtemp(prefix="kvtier-client-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    sides = {}
    try:
        kv_config = cfg.kvtier_config or _default_kv_config(cfg.workdir, node_memory)
        for side in SIDES:
            sides[side] = run_side(side, cfg, model_dir, kv_config, dtype, log)
    finally:
        shutil.rmtree(node_memory, ignore_errors=True)
    expected = cfg.workload.requests
    summary = {
        "client": {"name": "guidellm", "command": cfg.guidellm,
                   "version": next((s["version"] for s in sides.values() if "version" in s), "unknown")},
        "model": cfg.model, "dtype": dtype, "processes": cfg.processes, "workload": cfg.workload.as_dict(),
        "engine": {"max_model_len": cfg.max_model_len(), "kv_blocks": cfg.kv_blocks_for(),
                   "block_tokens": BLOCK_TOKENS, "prefix_caching": True},
        "kvtier_config": str(cfg.kvtier_config or cfg.workdir / "kvtier.yaml"),
        "sides": sides, "ratio": compare(sides),
        "ok": all(side_ok(sides.get(s, {}), expected) for s in SIDES),
    }
    (cfg.workdir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ------------------------------------------------------------------ report and command line


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(summary: dict) -> str:
    wl = summary["workload"]
    lines = [f"{summary['client']['name']} {summary['client']['version']} against each server: {wl['sessions']} "
             f"sessions x {wl['turns']} turns, system prompt {wl['prefix_tokens']}, user text {wl['prompt_tokens']}, "
             f"answers {wl['output_tokens']} tokens, think {wl['think_s']:g} s, {wl['concurrency']} in flight; "
             f"{summary['model']} ({summary['dtype']}), {summary['engine']['kv_blocks']} KV blocks, "
             f"{summary['processes']} mode", ""]
    head = (f"{'side':<14}{'requests':>10}{'TTFT p50':>10}{'p90':>9}{'p99 ms':>9}{'out tok/s':>11}{'req/s':>8}"
            f"{'kvtier hits':>13}{'vLLM hits':>11}")
    lines += [head, "-" * len(head)]
    for name in SIDES:
        s = summary["sides"].get(name, {})
        if "error" in s and "ttft_ms" not in s:
            lines.append(f"{name:<14}failed: {s['error']}")
            continue
        t = s.get("ttft_ms") or {}
        srv = s.get("server") or {}
        req = f"{s.get('requests_ok', 0)}/{s.get('requests_ok', 0) + s.get('requests_failed', 0) + s.get('requests_incomplete', 0)}"
        lines.append(f"{name:<14}{req:>10}{_num(t.get('p50'), '.0f'):>10}{_num(t.get('p90'), '.0f'):>9}"
                     f"{_num(t.get('p99'), '.0f'):>9}{_num(s.get('output_tokens_per_s'), '.1f'):>11}"
                     f"{_num(s.get('requests_per_s'), '.2f'):>8}{_num(s.get('kvtier_hit_tokens'), '.0f'):>13}"
                     f"{_num(srv.get('prefix_cache_hits'), '.0f'):>11}")
    r = summary["ratio"]
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    lines.append(f"{'kvtier/vllm':<14}{'':>10}{x(r['ttft_p50']):>10}{x(r['ttft_p90']):>9}{x(r['ttft_p99']):>9}"
                 f"{x(r['output_tokens_per_s']):>11}{x(r['requests_per_s']):>8}")
    lines += ["", "TTFT: client side, send to first token, successful requests; throughput: GuideLLM's means over "
              "its run; hits: prompt tokens served by kvtier's tiers / by vLLM's own prefix cache (server /metrics)"]
    return "\n".join(lines)


def register(bsub) -> None:
    """``kvtier bench client`` on the ``kvtier bench`` subparsers."""
    import argparse

    p = bsub.add_parser(
        "client",
        help="a published client (GuideLLM) drives kvtier serve and plain vLLM: TTFT and throughput, side by side",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Runs GuideLLM (PyPI guidellm), a benchmark client kvtier does not write, against two servers one after\n"
            "the other, with the same multi-turn workload: plain vLLM (`kvtier serve --no-kvtier`: the same vLLM\n"
            "command, environment and process mode, without the connector), then `kvtier serve` with kvtier as its\n"
            "KV connector (by default a memory tier and a disk tier in DIR, emptied first). vLLM's prefix cache is\n"
            "on for both. Prints TTFT p50/p90/p99, output tokens/s and requests/s for each side and kvtier's over\n"
            "vLLM's, and the prompt tokens each server took from kvtier's tiers and from its own prefix cache.\n\n"
            "workload (GuideLLM's synthetic multi-turn data and its concurrent profile): SESSIONS conversations of\n"
            "TURNS turns; the first turn is a system prompt shared by all (--prefix-tokens) plus user text\n"
            "(--prompt-tokens); each later turn resends the whole history as text after a think time (--think);\n"
            "CONCURRENCY requests in flight, further conversations started while others think. The engine's KV\n"
            "holds the longest prompt once per request in flight (--kv-blocks), so returning sessions find their\n"
            "prefix evicted from vLLM's cache: the case a KV tier is for.\n\n"
            "The model is a preset of kvtier.bench.tinymodels with dummy weights and a byte-level tokenizer written\n"
            "beside it (no download; GuideLLM tokenizes with it offline).\n\n"
            "writes DIR/results.json, DIR/vllm/guidellm.json, DIR/kvtier/guidellm.json and DIR/logs/\n\n"
            "needs GuideLLM: " + guidellm.INSTALL_HINT),
    )
    wl = guidellm.Workload()
    p.add_argument("--model", default="qwen2.5-0.5b", help="model preset: qwen2.5-0.5b (default), tiny-llama, tiny-qwen2")
    p.add_argument("--dir", default="results/client", help="working directory (default results/client)")
    p.add_argument("--sessions", type=int, default=wl.sessions, help=f"conversations (default {wl.sessions})")
    p.add_argument("--turns", type=int, default=wl.turns, help=f"requests per conversation (default {wl.turns})")
    p.add_argument("--prefix-tokens", type=int, default=wl.prefix_tokens,
                   help=f"system prompt shared by every conversation, tokens; 0 for none (default {wl.prefix_tokens})")
    p.add_argument("--prompt-tokens", type=int, default=wl.prompt_tokens,
                   help=f"user text per turn, tokens (default {wl.prompt_tokens})")
    p.add_argument("--output-tokens", type=int, default=wl.output_tokens,
                   help=f"answer per turn, tokens (default {wl.output_tokens})")
    p.add_argument("--think", type=float, default=wl.think_s,
                   help=f"mean think time between a conversation's turns, seconds (default {wl.think_s:g})")
    p.add_argument("--concurrency", type=int, default=wl.concurrency, help=f"requests in flight (default {wl.concurrency})")
    p.add_argument("--seed", type=int, default=0, help="GuideLLM's seed, the same for both servers (default 0)")
    p.add_argument("--kv-blocks", type=int, help="engine KV blocks of 128 tokens (default: the longest prompt's "
                   "blocks + 1, times --concurrency)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="dummy weights' dtype (default auto: bfloat16 where the host computes it natively, else float32)")
    p.add_argument("--processes", choices=PROCESS_MODES, default="multiprocess",
                   help="vLLM's process mode for both servers: multiprocess (vLLM's default, as kvtier serve runs "
                   "in production: API server, engine core, worker) or single (VLLM_ENABLE_V1_MULTIPROCESSING=0: "
                   "engine and worker in one process; starts in seconds)")
    p.add_argument("--kvtier-config", help="the kvtier side's config file (default: a memory tier and a disk tier "
                   "in DIR/store, emptied before the run)")
    p.add_argument("--guidellm", help="the guidellm command (default: the one installed beside this Python, "
                   "else the first on PATH)")
    p.add_argument("--json", help="also write the summary to this JSON file")
    p.set_defaults(func=cmd_bench_client)


def cmd_bench_client(args) -> int:
    exe = guidellm.find(args.guidellm)
    if exe is None:
        where = f"--guidellm {args.guidellm}: no such command" if args.guidellm else "GuideLLM is not installed"
        print(f"kvtier bench client: {where}. Install it with:\n  {guidellm.INSTALL_HINT}", file=sys.stderr)
        return 2
    wl = guidellm.Workload(sessions=args.sessions, turns=args.turns, prefix_tokens=args.prefix_tokens,
                           prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, think_s=args.think,
                           concurrency=args.concurrency, seed=args.seed)
    cfg = ClientBenchConfig(workdir=Path(args.dir), model=args.model, workload=wl, dtype=args.dtype,
                            processes=args.processes, kv_blocks=args.kv_blocks,
                            kvtier_config=Path(args.kvtier_config) if args.kvtier_config else None, guidellm=exe)
    cfg.validate()  # a ConfigError here: exit status 2 with the flag and the fix (kvtier.cli)
    summary = run(cfg, log=lambda msg: print(f"kvtier bench client: {msg}", flush=True))
    print(format_table(summary))
    paths = [cfg.workdir / "results.json"]
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        paths.append(Path(args.json))
    print("\nwrote " + ", ".join(str(q) for q in paths))
    if not summary["ok"]:
        bad = [f"{n}: {s.get('error') or 'requests failed'}" for n, s in summary["sides"].items()
               if not side_ok(s, wl.requests)]
        print("kvtier bench client: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0
