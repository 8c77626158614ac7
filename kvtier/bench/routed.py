"""``kvtier bench resume --workload w3 --routing random,sticky,events``: W3
through live ``kvtier serve`` servers that the benchmark starts on this host,
once per routing, in one run.

For each routing and context the run starts ``--instances`` servers, all
reading one shared-tier folder (emptied first: no routing is served by what
an earlier one stored), each with its own node-memory folder, HTTP port and
KV-event endpoints (``--kv-events-config``: publisher and replay, on
loopback). Their engines are set as the in-process W3 engines are
(``resume_configs.engine_args``: the model, its length, the KV blocks, one
process unless the configuration is ``NAME+mp``). Every server gets an
equal share of the host's CPUs (``cpu_plan``): its own CPUs where they
divide evenly, otherwise all of them unpinned with an equal thread count,
because pinning three engines to two CPUs makes one engine twice as fast
as the other two, and then the routing that happens to send more sessions
there wins, whatever it knows. ``kvtier.bench.endpoint`` then runs the workload
against them with the routing (``events``: the servers' own event streams,
``kvtier.routing``), and the servers are stopped (SIGTERM through ``kvtier
serve``, also on Ctrl-C or an error) before the next routing starts.

Before each cold phase the shared folder's files are dropped from this
host's page cache (the servers read them cold, as the in-process runs do);
what the engines hold themselves stays: a live server's prefix cache cannot
be emptied from outside, and whatever it still holds is what a router can
use.

With ``--rounds N`` the routings run N times, in ABBA order (odd rounds
reversed), each time on fresh servers and an empty shared tier; a row
pools its rounds' requests and keeps each round's TTFT p50 beside.

The report is ``kvtier bench resume``'s, one row per routing (named
after it; the configuration is the summary's ``config``), plus per routing: TTFT p95, hits by tier against
vLLM's external prefix-cache hits, and how many resumes went to the instance
that served the session first; ``report/summary.{json,md}`` as well.

Thread ownership: everything runs on the caller's thread; each server is a
child process (with its own session) that this module starts, waits for and
stops; the events routing's subscriber threads live inside
``endpoint.run_workload``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtier.bench import client, endpoint
from kvtier.bench import workloads as wl
from kvtier.bench.resume_configs import BLOCK, MP, ResumeConfig, engine_spec
from kvtier.bench.resume_report import pct

ROUTINGS = ("random", "sticky", "events")
DEFAULT_CONFIG = "kvtier-shared"
MODEL_NAME = "w3"
# What the in-process runner sets before a spec's own engine arguments (vllm_runner.main).
RUNNER_DEFAULTS = {"skip_tokenizer_init": True, "dtype": "float32", "enforce_eager": True,
                   "enable_prefix_caching": True}


@dataclass(frozen=True)
class Server:
    url: str
    events: str   # tcp://127.0.0.1:PORT?replay=tcp://127.0.0.1:PORT, as kvtier.routing takes it
    log: Path
    command: list[str]


def vllm_flags(engine: dict) -> list[str]:
    """Engine keyword arguments as ``vllm serve`` flags: ``True`` as the bare
    flag, ``False`` as ``--no-FLAG``, mappings as JSON."""
    out = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def kvtier_file(extra: dict) -> dict:
    """The in-process connector's settings as a config file: store keys at
    the top, the connector's own keys in its ``vllm:`` section."""
    from kvtier.integrations.vllm.settings import CONNECTOR_KEYS, SECTION

    out = {k: v for k, v in extra.items() if k not in CONNECTOR_KEYS}
    own = {k: v for k, v in extra.items() if k in CONNECTOR_KEYS}
    if own:
        out[SECTION] = own
    return out


def _ports(n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        p = client._free_port()
        if p not in got:
            got.append(p)
    return got


def drop_page_cache(folder: Path) -> None:
    """Drop every file under ``folder`` from this host's page cache."""
    from kvtier.bench.vllm_runner import _drop_dir_cache

    with contextlib.suppress(OSError):
        _drop_dir_cache(folder)


def cpu_plan(cpus: list[int], instances: int) -> list[dict[str, str]]:
    """Per server, the CPU settings of its engine: an equal share each.
    Where the CPUs divide evenly among the servers, each is bound to its own
    (``VLLM_CPU_OMP_THREADS_BIND`` as vLLM takes it, ``0,1`` or ``2``);
    otherwise none is bound (``nobind``) and each runs
    ``len(cpus) // instances`` threads (at least one), sharing all of them
    under the kernel's scheduler."""
    if instances <= len(cpus) and len(cpus) % instances == 0:
        per = len(cpus) // instances
        return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus[i * per:(i + 1) * per])}
                for i in range(instances)]
    threads = str(max(1, len(cpus) // instances))
    return [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads} for _ in range(instances)]


@contextlib.contextmanager
def servers(cfg: ResumeConfig, name: str, label: str, workload: wl.Workload, model_dir: Path, tag: str,
            log: Callable[[str], None] = print, start_timeout_s: float = 900.0):
    """``workload.instances`` servers of configuration ``name``, started
    together and healthy; stopped on leaving, whatever happened."""
    logs = cfg.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = cpu_plan(sorted(os.sched_getaffinity(0)), workload.instances)
    processes = "multiprocess" if name.endswith(MP) else "single"
    started: list[tuple] = []
    private: list[str] = []
    try:
        fleet = []
        for i in range(workload.instances):
            node_memory = tempfile.mkdtemp(prefix="kvtier-w3-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            tmp = tempfile.mkdtemp(prefix="kvw3-")  # short: vLLM's IPC socket paths live under it
            private += [node_memory, tmp]
            spec = engine_spec(cfg, name, label, workload, model_dir, i, None, node_memory)
            port, events_port, replay_port = _ports(3)
            kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                         # vLLM binds a wildcard endpoint and connects to any other.
                         "endpoint": f"tcp://*:{events_port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
            if spec["kvtier"] is None:
                own = ["--no-kvtier"]
            else:
                conf = Path(tmp) / "kvtier.json"
                conf.write_text(json.dumps(kvtier_file(spec["kvtier"]), indent=2) + "\n")
                own = ["--config", str(conf)]
            argv = [sys.executable, "-m", "kvtier.cli", "serve", spec["model"], *own,
                    "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
                    *vllm_flags({**RUNNER_DEFAULTS, **spec["engine"]}), "--enable-prompt-tokens-details",
                    "--disable-uvicorn-access-log", "--kv-events-config", json.dumps(kv_events)]
            env = client.server_env(client.ClientBenchConfig(workdir=cfg.workdir, processes=processes), Path(tmp))
            env.update(plan[i])
            server_log = logs / f"{cfg.workload}-{tag}-{label}-i{i}.log"
            with open(server_log, "wb") as fh:
                proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)
            started.append((proc, server_log))
            fleet.append(Server(f"http://127.0.0.1:{port}",
                                f"tcp://127.0.0.1:{events_port}?replay=tcp://127.0.0.1:{replay_port}",
                                server_log, argv))
        log(f"{tag} ({label}): starting {len(fleet)} servers (logs {logs}/{cfg.workload}-{tag}-{label}-i*.log)")
        for srv, (proc, server_log) in zip(fleet, started):
            client._wait_healthy(srv.url, proc, server_log, start_timeout_s)
        yield fleet
    finally:
        for proc, _ in started:
            client._stop(proc)
        for path in private:
            shutil.rmtree(path, ignore_errors=True)


def run_routed(cfg: ResumeConfig, routings: tuple[str, ...],
               progress: Callable[[str, int], Callable[[int], None]] | None = None, log=print) -> dict:
    """W3 through each of ``routings`` in turn, on servers of its own."""
    from kvtier.bench import resume

    cfg.workdir.mkdir(parents=True, exist_ok=True)
    todo = resume.cases(cfg)
    model_dir = resume.build_model(cfg, todo)
    name = cfg.configs[0] if cfg.configs else DEFAULT_CONFIG
    runs, failed, notes = [], [], []
    per_server: dict = {}
    events: dict = {}
    commands: dict = {}
    rounds = max(1, cfg.rounds)
    order = [(rnd, routing) for rnd in range(rounds) for routing in (routings[::-1] if rnd % 2 else routings)]
    for label, workload in todo:
        store = cfg.workdir / "stores" / f"{cfg.workload}-{name}-{label}"  # engine_spec's shared folder
        for rnd, routing in order:
            row = routing
            tag = routing if rounds == 1 else f"{routing}-r{rnd}"
            # Every routing starts from an empty store: nothing an earlier one stored may hit.
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
            try:
                with servers(cfg, name, label, workload, model_dir, tag, log) as fleet:
                    commands.setdefault(label, {})[routing] = [" ".join(s.command) for s in fleet]
                    spec = routing
                    if routing == "events":
                        spec = "events=" + ",".join(s.events for s in fleet)

                    def cold(store=store) -> str:
                        drop_page_cache(store)
                        return ("cold phases: the shared folder's files dropped from the page cache first; the "
                                "servers' own prefix caches keep what they hold")

                    result = endpoint.run_workload(workload, [s.url for s in fleet], spec, progress,
                                                   models=[MODEL_NAME] * len(fleet), seed=cfg.seed,
                                                   timeout_s=cfg.engine_timeout_s, block_tokens=BLOCK,
                                                   before_cold=cold)
            except (RuntimeError, endpoint.EndpointError, OSError) as exc:
                # One routing failing must not cost the others' figures.
                log(f"{tag} ({label}) failed; going on without it: {str(exc).splitlines()[0]}")
                failed.append({"config": row, "case": label, "round": rnd, "error": str(exc)[-1500:]})
                continue
            runs.append({**endpoint.as_resume_run(result, config=row, case=label), "round": rnd})
            notes += [n for n in result["notes"] if n not in notes]
            per_server.setdefault(label, {})[tag] = {
                ph["name"]: [{"endpoint": s["endpoint"], "requests": s["requests"], **s["summary"]}
                             for s in ph["servers"]] for ph in result["phases"]}
            if result.get("events"):
                events.setdefault(label, {})[tag] = result["events"]
    if not runs:
        raise RuntimeError("every routing failed:\n" + "\n".join(f["error"] for f in failed))
    resume._write_requests(cfg.workdir / "report" / "requests.jsonl", cfg, runs)
    return summarise(cfg, name, routings, runs, failed, notes, per_server, events, commands)


def resumes_on_warm_instance(records: list[dict]) -> tuple[int, int]:
    """(resumes served by the instance that served the session's first
    request, resumes): how often a routing put a return where it began."""
    first = {r["session"]: r["endpoint"] for r in records if r["phase"] == "warm"}
    resumes = [r for r in records if r["phase"] != "warm" and r["session"] in first]
    return sum(1 for r in resumes if r["endpoint"] == first[r["session"]]), len(resumes)


def summarise(cfg: ResumeConfig, name: str, routings: tuple[str, ...], runs: list[dict], failed: list[dict],
              notes: list[str], per_server: dict, events: dict, commands: dict) -> dict:
    from kvtier.bench.resume_report import summarise as resume_summary

    s = resume_summary(cfg, runs, {}, {})
    by_row: dict = {}
    for r in runs:
        by_row.setdefault((r["case"], r["config"]), []).append(r)
    for (case, row), mine in by_row.items():
        v = s["results"][case][row]
        v["ttft_p95_s"] = pct(v["ttft_s"], 0.95)
        pairs = [resumes_on_warm_instance(r["records"]) for r in mine]
        v["resumes_on_warm_instance"], v["resumes"] = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        # Each round's own p50, in round order: the spread the pooled p50 hides.
        v["ttft_p50_s_rounds"] = [pct([rec["ttft_s"] for rec in r["records"] if rec["phase"] in r["measured"]], 0.5)
                                  for r in sorted(mine, key=lambda r: r.get("round", 0))]
    s.update(kind="routed", config=name, routings=list(routings), instances=cfg.instances, notes=notes,
             per_server_by_routing=per_server, events=events, server_commands=commands, failed=failed,
             description=(f"W3 multi-instance cold resume, {cfg.instances} live servers (kvtier serve, {name}) "
                          f"started per routing, {cfg.sessions} sessions per context, routed "
                          f"{', '.join(routings)}"
                          + (f", {cfg.rounds} rounds (ABBA)" if cfg.rounds > 1 else "")))
    return s


def format_table(s: dict) -> str:
    from kvtier.bench.resume_report import format_table as resume_table

    lines = [resume_table(s), "", "per routing: TTFT p50 / p95, req/s, kvtier hit tokens by tier, vLLM's external "
             "prefix-cache hits, resumes served where the session began, each round's TTFT p50"]
    for case, by in s["results"].items():
        for row, v in by.items():
            hits = ", ".join(f"{t} {n:.0f}" for t, n in sorted(v["hit_tokens"].items())) or "-"
            lines.append(f"  {case:>8} {row:<8} {v['ttft_p50_s']:.3f}s / {v['ttft_p95_s']:.3f}s  "
                         f"{v['throughput_rps']:.2f}  {hits}  {v['vllm_external_prefix_cache_hits']:.0f}  "
                         f"{v['resumes_on_warm_instance']}/{v['resumes']}  "
                         + " ".join(f"{x:.3f}s" for x in v.get("ttft_p50_s_rounds", [])))
    for case, by_routing in s.get("per_server_by_routing", {}).items():
        for routing, phases in by_routing.items():
            lines += ["", f"per server ({case}, {routing}): requests, kvtier hit tokens by tier, vLLM external hits"]
            for phase, srvs in phases.items():
                for srv in srvs:
                    ev = srv.get("events")
                    lines.append(f"  {phase:<8} {srv['endpoint']:<24} {srv['requests']:>4.0f}  "
                                 f"{srv.get('kvtier_hit_tokens_by_tier', {})}  "
                                 f"{srv.get('external_prefix_cache_hits', 0):.0f}"
                                 + (f"  events {ev['events']:.0f}, missed {ev['missed']:.0f}" if ev else ""))
    return "\n".join(lines)


def write_report(s: dict, out_dir: Path) -> list[Path]:
    """``kvtier bench resume``'s report files, and ``summary.{json,md}``."""
    from kvtier.bench.resume_report import write_report as resume_write, write_summary

    paths = resume_write(s, out_dir)
    (out_dir / "report.md").write_text("# kvtier bench resume\n\n```\n" + format_table(s) + "\n```\n\n"
                                       "![TTFT CDF](ttft_cdf.png)\n\n![hits per tier](hits.png)\n\n"
                                       "Per-request log: `requests.jsonl` (one JSON record per request).\n")
    return paths + write_summary(s, out_dir, "summary", format_table(s))
