"""``kvtier bench resume``: the cold-resume experiment, configurations side by side.

Each configuration runs the same workload (``kvtier.bench.workloads``) in its
own engine processes, one configuration after the other, never two
configurations at once (they would share the cores). The configurations, and
what each one's engines are given, are in ``kvtier.bench.resume_configs``, with
the run's settings (``ResumeConfig``).

Workloads: W1 long-context cold resume (per context length), W2 multi-turn
chat, W3 multi-instance cold resume (K engine processes at once, pinned to
the host's CPUs in turn), W0 zero-hit overhead (distinct prompts only, so the
connector can only cost). Peers that cannot run on this host are reported with
the reason, not dropped. TTFT is measured client-side, from sending a request
to its first token.

With ``--concurrency`` W1 becomes a sweep (``kvtier.bench.sweep``): bursts
of 1, 8, 16 ... sessions returning at once, each against what the device
gives that many streams (fio, same run) and the floor that rate and the
engine's own compute allow.

With ``--rates`` W2 runs at several arrival rates, one phase each
(``kvtier.bench.goodput``): TTFT p95 per rate against an SLO, the goodput
and the knee of each configuration.

For W1 the run also measures the floor a resume from storage cannot beat: the
engine's own TTFT on a memory-tier hit plus the bytes read per resume over the
storage's sequential read bandwidth, measured by fio in the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from kvtier.bench import workloads as wl
from kvtier.bench.engine_env import engine_env
from kvtier.bench.resume_configs import (BLOCK, CHUNK, MP, NO_CONNECTOR, ResumeConfig, base_config, engine_spec,
                                         longest_request, unavailable_peers)
from kvtier.bench.resume_report import summarise
from kvtier.bench.tinymodels import PRESETS, build_checkpoint, build_config_only, resolve_dtype

WORKLOADS = ("w1", "w2", "w3", "w0")


def cases(cfg: ResumeConfig) -> list[tuple[str, wl.Workload]]:
    """(label, workload) pairs the run measures, one row group each."""
    vocab = cfg.vocab or PRESETS[cfg.model][6]
    if cfg.sweep:
        return [(str(c), wl.w1_sweep(cfg.concurrency, c, vocab, cfg.seed, cfg.answer_tokens)) for c in cfg.contexts]
    if cfg.workload == "w1":
        return [(str(c), wl.w1(cfg.sessions, c, vocab, cfg.seed, cfg.resumes)) for c in cfg.contexts]
    if cfg.workload == "w3":
        return [(str(c), wl.w3(cfg.sessions, c, vocab, cfg.instances, cfg.seed, cfg.resumes)) for c in cfg.contexts]
    if cfg.goodput:
        from kvtier.bench import goodput

        return [("chat", goodput.workload(cfg.chat, cfg.rates, vocab, cfg.seed))]
    if cfg.workload == "w2":
        return [("chat", wl.w2(cfg.chat, vocab, cfg.seed))]
    return [(str(c), wl.w0(cfg.sessions, c, vocab, cfg.seed)) for c in cfg.contexts]


def run(cfg: ResumeConfig, progress: Callable[[str, int], Callable[[int], None]] | None = None, log=print) -> dict:
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    todo = cases(cfg)
    model_dir = build_model(cfg, todo)
    missing = unavailable_peers()
    device: dict = {}
    if cfg.sweep:
        from kvtier.bench import sweep

        device = sweep.measure_device(cfg, log)
        if device.get("local_drive_skipped") and any(base_config(n) == "kvtier-local-drive" for n in cfg.config_names()):
            missing["kvtier-local-drive"] = device["local_drive_skipped"]
    names = tuple(n for n in cfg.config_names() if n not in missing and base_config(n) not in missing)
    rounds = cfg.repeats if cfg.workload == "w0" else max(1, cfg.rounds)
    warm = cfg.warmup and bool(names)
    tick = (progress or (lambda d, t: (lambda n: None)))("engine runs", len(todo) * (len(names) * rounds + warm))
    runs: list[dict] = []
    failed: list[dict] = []
    fio: dict[str, dict] = {}
    for label, workload in todo:
        if warm:
            # On this project's 2-core host the first engine of a run resumed
            # 10-60 % slower, whatever it ran: that run is thrown away.
            first = round_order(names, 0, cfg.workload)[0]
            try:
                _run_config(cfg, first, label, workload, model_dir, -1, device)
            except RuntimeError as exc:
                log(f"warm-up run ({first}, {label}) failed; measuring anyway: {str(exc).splitlines()[0]}")
            tick(1)
        for rnd in range(rounds):
            for name in round_order(names, rnd, cfg.workload):
                try:
                    runs.append(_run_config(cfg, name, label, workload, model_dir, rnd, device))
                except RuntimeError as exc:
                    # One configuration failing (a peer's bug, a crash) must
                    # not cost the others' figures: report it and go on.
                    log(f"{name} ({label}) failed; going on without it: {str(exc).splitlines()[0]}")
                    failed.append({"config": name, "case": label, "round": rnd, "error": str(exc)[-1500:]})
                tick(1)
        if cfg.workload == "w1" and not cfg.sweep and cfg.fio and "kvtier-shared" in names:
            fio[label] = _fio(cfg.workdir / "stores" / f"{cfg.workload}-kvtier-shared-{label}", log)
    if not runs:
        raise RuntimeError("every configuration failed:\n" + "\n".join(f["error"] for f in failed))
    if cfg.sweep:
        summary = sweep.summarise(cfg, runs, device, missing, todo[0][1].description)
    elif cfg.goodput:
        from kvtier.bench import goodput

        summary = goodput.summarise(cfg, runs, missing)
    else:
        summary = summarise(cfg, runs, fio, missing)
    summary["failed"] = failed
    _write_requests(cfg.workdir / "report" / "requests.jsonl", cfg, runs)
    return summary


def build_model(cfg: ResumeConfig, todo: list[tuple[str, wl.Workload]]) -> Path:
    """The model directory the engines load: its config only (dummy
    weights) or a random-init checkpoint, long enough for every request."""
    max_len = max(longest_request(w) for _, w in todo) + 2 * BLOCK
    if cfg.dummy_weights:
        dtype = resolve_dtype(cfg.dtype)
        return build_config_only(cfg.model, cfg.workdir / "models" / f"{cfg.model}-{dtype}", max_len=max_len,
                                 dtype=dtype)
    return build_checkpoint(cfg.model, cfg.workdir / "models" / f"{cfg.model}-ckpt", max_len=max_len)


def round_order(names: tuple[str, ...], rnd: int, workload: str) -> tuple[str, ...]:
    """The configurations' order in round ``rnd``. Rounds alternate them so
    that drift of a noisy host hits all alike: W0 in the same order each
    round (its bar pairs round by round); the others ABBA, odd rounds
    reversed, because on this project's 2-core host the first engine of a
    run resumed up to 2 s slower whichever configuration it ran
    (docs/benchmarks.md, process topologies)."""
    return names[::-1] if rnd % 2 and workload != "w0" else names


def run_endpoints(cfg: ResumeConfig, endpoints: list[str], routing: str = "workload", label: str = "endpoint",
                  progress: Callable[[str, int], Callable[[int], None]] | None = None) -> dict:
    """The same workloads against live OpenAI-compatible servers (``kvtier
    serve`` or ``vllm serve`` with the connector): one configuration, named
    ``label``, whatever the servers run. Hits per tier and per server come
    from their ``/metrics``, scraped around each phase."""
    from kvtier.bench import endpoint

    runs, notes, per_server = [], [], {}
    for case, workload in cases(cfg):
        result = endpoint.run_workload(workload, endpoints, routing, progress, block_tokens=BLOCK)
        runs.append(endpoint.as_resume_run(result, config=label, case=case))
        notes += [n for n in result["notes"] if n not in notes]
        per_server[case] = {ph["name"]: [{"endpoint": srv["endpoint"], "requests": srv["requests"], **srv["summary"]}
                                         for srv in ph["servers"]] for ph in result["phases"]}
    summary = summarise(cfg, runs, {}, {})
    summary.update(endpoints=list(endpoints), routing=routing, notes=notes, per_server=per_server,
                   instances=len(endpoints))
    _write_requests(cfg.workdir / "report" / "requests.jsonl", cfg, runs)
    return summary


def _write_requests(path: Path, cfg: ResumeConfig, runs: list[dict]) -> None:
    """One line per request of every run: the request log ``kvtier plan`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in runs:
            for rec in r["records"]:
                f.write(json.dumps({"workload": cfg.workload.upper(), "config": r["config"], "case": r["case"],
                                    "round": r["round"], "model": cfg.model, **rec}) + "\n")


@contextlib.contextmanager
def _throttled_mount(cfg: ResumeConfig, name: str, store: Path):
    """For kvtier-throttled: ``store`` is a faultfs mount (of a folder beside
    it) whose reads go at ``cfg.throttle_bps``, for as long as the engines run."""
    if base_config(name) != "kvtier-throttled":
        yield
        return
    from kvtier.bench.faultfs import mounted

    source = store.with_name(store.name + "-source")
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    with mounted(source, store) as fs:
        fs.set(read_bps=cfg.throttle_bps)
        yield
    shutil.rmtree(source, ignore_errors=True)


@contextlib.contextmanager
def _local_drive(cfg: ResumeConfig, name: str, store: Path, device: dict):
    """The block throttle an engine runs under (blkio.py), or None: for
    kvtier-local-drive at the rate ``measure_device`` set; with
    ``device_bps``, for every kvtier configuration reading files, at it."""
    base = base_config(name)
    bps = device.get("local_drive_bps") if base == "kvtier-local-drive" else None
    if bps is None and cfg.device_bps and base.startswith("kvtier") and base not in ("kvtier-memory", "kvtier-throttled"):
        bps = cfg.device_bps
    if not bps:
        yield None
        return
    from kvtier.bench.blkio import ReadThrottle

    with ReadThrottle(store, bps) as throttle:
        yield throttle


def _run_config(cfg: ResumeConfig, name: str, label: str, workload: wl.Workload, model_dir: Path, rnd: int,
                device: dict | None = None) -> dict:
    """Run ``workload`` under configuration ``name`` in its engine process(es)."""
    if cfg.sweep and base_config(name) in NO_CONNECTOR:
        workload = wl.Workload(workload.name, workload.description,
                               tuple(p for p in workload.phases if p.name != "warm"), workload.instances,
                               workload.params)
    logs = cfg.workdir / "logs"
    logs.mkdir(exist_ok=True)
    store = cfg.workdir / "stores" / f"{cfg.workload}-{name}-{label}"
    # Every run starts from an empty store: nothing left from a previous run may hit.
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)  # a shared tier's folder must exist, as a mount point does
    k = workload.instances
    cpus = sorted(os.sched_getaffinity(0))
    # The node's memory tier lives in tmpfs beyond this run unless removed:
    # each run gets a fresh one (its instances share it, as on one node).
    node_memory = tempfile.mkdtemp(prefix="kvtier-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with (tempfile.TemporaryDirectory() as tmp, _throttled_mount(cfg, name, store),
          _local_drive(cfg, name, store, device or {}) as throttle):
        barrier = Path(tmp) / "barrier" if k > 1 else None
        if barrier:
            barrier.mkdir()
        procs = []
        for i in range(k):
            spec_path, out_path = Path(tmp) / f"spec-{i}.json", Path(tmp) / f"out-{i}.json"
            spec_path.write_text(json.dumps(engine_spec(cfg, name, label, workload, model_dir, i, barrier, node_memory)))
            env = engine_env()
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if name.endswith(MP) else "0"
            if name == "lmcache":
                env.update(LMCACHE_CHUNK_SIZE=str(CHUNK), LMCACHE_LOCAL_CPU="True", LMCACHE_MAX_LOCAL_CPU_SIZE="8")
            if k > 1:
                # Instances share the host's CPUs in turn; unpinned OpenMP teams thrash.
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
            elif cfg.tensor_parallel > 1:
                # One CPU per rank, as vLLM's CPU backend binds them.
                env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(cfg.tensor_parallel))
            engine_log = logs / f"{cfg.workload}-{name}-{label}-{f'r{rnd}' if rnd >= 0 else 'warmup'}-i{i}.log"
            f = open(engine_log, "w")
            # Under a throttle, the engine (and every process it starts)
            # joins its control group before it reads a byte.
            join = (lambda t=throttle: t.join(os.getpid())) if throttle else None
            p = subprocess.Popen([sys.executable, "-m", "kvtier.bench.vllm_runner", str(spec_path), str(out_path)],
                                 stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=join)
            procs.append((p, f, engine_log, out_path))
        try:
            if barrier:
                _release_phases(workload, barrier, procs, cfg.engine_timeout_s)
            outs = []
            for p, f, engine_log, out_path in procs:
                rc = p.wait(timeout=cfg.engine_timeout_s)
                f.close()
                if rc != 0:
                    raise RuntimeError(f"{name} ({label}) failed (exit {rc}); log: {engine_log}\n"
                                       + engine_log.read_text()[-2000:])
                outs.append(json.loads(out_path.read_text()))
        finally:
            for p, f, _, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                f.close()
            shutil.rmtree(node_memory, ignore_errors=True)
    records = [rec for o in outs for rec in o["records"]]
    measured = {p.name for p in workload.phases if p.measured}
    spans: dict[str, list[float]] = {}
    phase_metrics: dict[str, dict] = {}
    for o in outs:
        for ph in o["phases"]:
            spans.setdefault(ph["name"], []).extend([ph["t_start"], ph["t_end"]])
            got = phase_metrics.setdefault(ph["name"], {"kvtier": [], "vllm": []})
            got["kvtier"].append(ph.get("kvtier_metrics", {}))
            got["vllm"].append(ph.get("metrics", {}))
    return {
        "config": name, "case": label, "round": rnd, "instances": k, "records": records,
        "measured": sorted(measured),
        "span_s": {ph: max(ts) - min(ts) for ph, ts in spans.items()},
        # Counters as they stood after each phase, summed over instances.
        "phase_metrics": {ph: {"kvtier": _sum_metrics(m["kvtier"]), "vllm": _sum_metrics(m["vllm"])}
                          for ph, m in phase_metrics.items()},
        "kvtier_metrics": _sum_metrics(o.get("kvtier_metrics", {}) for o in outs),
        "vllm_metrics": _sum_metrics(o.get("metrics", {}) for o in outs),
    }


def _release_phases(workload: wl.Workload, barrier: Path, procs, timeout_s: float) -> None:
    """Start each phase on every instance at once: wait until all are ready
    for it (engines loaded, previous phase done), then let them go."""
    deadline = time.monotonic() + timeout_s
    for phase in workload.phases:
        while not all((barrier / f"ready-{phase.name}-{i}").exists() for i in range(len(procs))):
            for p, _, engine_log, _ in procs:
                if p.poll() is not None and p.returncode != 0:
                    raise RuntimeError(f"an instance failed (exit {p.returncode}); log: {engine_log}\n"
                                       + engine_log.read_text()[-2000:])
            if time.monotonic() > deadline:
                raise RuntimeError(f"instances not ready for phase {phase.name!r} after {timeout_s:.0f} s")
            time.sleep(0.05)
        (barrier / f"go-{phase.name}").touch()


def _sum_metrics(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
    return out


def _fio(store: Path, log) -> dict:
    """Sequential read bandwidth of the storage under the shared tier: the
    best of O_DIRECT 1 MiB reads at a few queue depths and of buffered
    128 KiB reads in ``BUFFERED_STREAMS`` streams at once (how kvtier's file tiers
    read by default), measured right after that configuration ran. The
    O_DIRECT jobs also run with their buffers on huge pages, as kvtier's
    are, where the host reserved enough (on 4 KiB pages fio read a third
    slower here: docs/benchmarks.md, "fio's buffers")."""
    from kvtier.bench.fio import (BUFFERED_STREAMS, FioMissing, fio_seq_read, fio_seq_read_run, huge_pages_short,
                                  remove_fio_file)

    try:
        used = sum(p.stat().st_size for p in store.rglob("*.kvc"))
        size = max(64 << 20, min(used, 1 << 30))
        depths = (1, 8, 32)
        bws = {f"qd{d}": fio_seq_read(store, d, size) for d in depths}
        if not huge_pages_short(depths):
            bws.update({f"qd{d}-huge": fio_seq_read_run(store, d, size, huge_pages=True).gbps for d in depths})
        bws[f"buffered-128k-x{BUFFERED_STREAMS}"] = fio_seq_read(store, 1, size, block="128k", direct=False,
                                                                 jobs=BUFFERED_STREAMS)
        return {"gbps_by_job": bws, "best_gbps": max(bws.values()), "size_bytes": size}
    except (FioMissing, RuntimeError, OSError) as exc:
        log(f"fio skipped: {exc}")
        return {"skipped": str(exc)}
    finally:
        remove_fio_file(store)
