"""Acceptance: two live vLLM OpenAI servers on loopback share one directory
tier; a W3 run through ``kvtier.bench.endpoint`` resumes on one server the
sessions the other one served, with the same output as a cache-off engine;
``kvtier serve`` stops cleanly on SIGTERM.

- Server A is started by ``kvtier serve`` (the supervisor: signals, metrics
  directory, process group). Its tiers: memory, then the shared directory.
- Server B runs the exact line ``kvtier serve --dry-run`` prints (through
  ``sh``), so the printed command is proven runnable as printed. Its tier:
  the shared directory only.
- The reference is an in-process engine without kvtier and without vLLM's
  prefix cache (``vllm_runner``), run while the servers start.

Geometry: vLLM's CPU block is 128 tokens, kvtier's chunk 256. A 512-token
prompt can take at most 384 cached tokens (one token is always computed).
Each server has 8 KV blocks and runs one request at a time (no batching, so
outputs are comparable bit for bit with the one-by-one reference): a second
session evicts most of the first, so a resume on the same server is served
partly by vLLM's prefix cache and the rest by kvtier.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from kvtier.bench import endpoint
from kvtier.bench.engine_env import engine_env
from kvtier.bench.tinymodels import PRESETS, build_checkpoint
from kvtier.bench.workloads import Workload, w3
from tests.integrations.vllm.conftest import REPO, run_engine, tail

pytestmark = pytest.mark.slow

CONTEXT = 512
SESSIONS = 4
MAX_TOKENS = 8
HIT = (CONTEXT - 1) // 128 * 128  # 384
VOCAB = PRESETS["tiny-llama"][6]
START_TIMEOUT_S = 240
VLLM_ARGS = [
    "--host", "127.0.0.1", "--skip-tokenizer-init", "--enable-prompt-tokens-details", "--dtype", "float32",
    "--enforce-eager", "--max-model-len", "640", "--kv-cache-memory-bytes", str(64 << 20),
    "--num-gpu-blocks-override", "8", "--max-num-seqs", "1", "--served-model-name", "tiny",
    "--disable-uvicorn-access-log",
]


def workload() -> Workload:
    """W3 over 2 instances with 8-token answers; the first seed whose random
    placement moves sessions both ways (warmed on A, resumed on B and back)."""
    for seed in range(100):
        wl = w3(SESSIONS, CONTEXT, VOCAB, instances=2, seed=seed)
        warm = {r.session: r.instance for r in wl.phases[0].requests}
        moves = {(warm[r.session], r.instance) for r in wl.phases[1].requests}
        if (0, 1) in moves and (1, 0) in moves:
            phases = tuple(dataclasses.replace(p, requests=tuple(dataclasses.replace(r, max_tokens=MAX_TOKENS)
                                                                 for r in p.requests)) for p in wl.phases)
            return dataclasses.replace(wl, phases=phases)
    raise AssertionError("no seed moves sessions both ways")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(cpu: str, tmpdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVTIER_") and k not in ("PROMETHEUS_MULTIPROC_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env = engine_env(env)  # tcmalloc + iomp when present, HF offline
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # kvtier serve decides (and prints) it
    env.update(VLLM_CPU_OMP_THREADS_BIND=cpu, TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmpdir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])))
    return env


def kvtier_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", *args]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server {url} exited with {proc.returncode}; log tail:\n{tail(log.read_text(errors='replace'))}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server {url} not healthy after {START_TIMEOUT_S} s; log tail:\n{tail(log.read_text(errors='replace'))}")


def stop_group(proc: subprocess.Popen) -> None:
    """Test cleanup: the process group of a server we started, whatever state
    it is in, and the /dev/shm OpenMP registrations its processes leave
    (server B runs without kvtier serve, which would remove them)."""
    try:
        pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        pids = [proc.pid]
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    for pid in pids:
        if not psutil.pid_exists(pid):
            for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                f.unlink(missing_ok=True)


def test_two_servers_resume_each_others_sessions_and_kvtier_serve_stops_cleanly(tmp_path):
    t_start = time.monotonic()
    cpus = sorted(os.sched_getaffinity(0))
    cpu_a, cpu_b = str(cpus[0]), str(cpus[-1])
    model = build_checkpoint("tiny-llama", tmp_path / "model")
    shared = tmp_path / "shared"
    shared.mkdir()  # a shared tier's folder must exist (a mount point)
    cfg_a, cfg_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    # A's memory tier is the node's (shm): a folder of this test's own.
    node_memory = Path(tempfile.mkdtemp(prefix="kvs-node-", dir="/dev/shm"))
    # The hits asserted here must not hang on timing: a tiny model computes a
    # token about as fast as a tier loads it, so under load_decision auto a
    # server may rightly recompute (the decision has tests of its own).
    always = "vllm:\n  load_decision: always\n"
    cfg_a.write_text(f"node_memory_dir: {node_memory}\n"
                     f"tiers:\n  - kind: memory\n    capacity: 64MiB\n"
                     f"  - kind: shared\n    path: {shared}\n    capacity: 256MiB\n" + always)
    cfg_b.write_text(f"tiers:\n  - kind: shared\n    path: {shared}\n    capacity: 256MiB\n" + always)
    wl = workload()
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    # Short TMPDIRs: vLLM puts ZMQ IPC sockets there (a socket path has at most 107 bytes).
    tmp_a = Path(tempfile.mkdtemp(prefix="kvs-a-"))
    tmp_b = Path(tempfile.mkdtemp(prefix="kvs-b-"))
    prom_b = tmp_path / "prom-b"
    prom_b.mkdir()

    procs: list[subprocess.Popen] = []
    ref_out: dict = {}
    try:
        # B: the line `kvtier serve --dry-run` prints, run as printed.
        env_b = base_env(cpu_b, tmp_b)
        env_b["PROMETHEUS_MULTIPROC_DIR"] = str(prom_b)
        dry = subprocess.run(kvtier_cmd("serve", str(model), "--config", str(cfg_b), "--dry-run", "--port", str(port_b),
                                        *VLLM_ARGS), env=env_b, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        line_b = dry.stdout.strip()
        assert "\n" not in line_b
        words = shlex.split(line_b)
        # vLLM's default process mode: the engine core and its worker are processes of their own.
        assert words[0] == f"PROMETHEUS_MULTIPROC_DIR={prom_b}"
        assert not any(w.startswith("VLLM_ENABLE_V1_MULTIPROCESSING") for w in words), line_b
        ktc = json.loads(words[words.index("--kv-transfer-config") + 1])
        assert ktc == {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"config": str(cfg_b)}}

        log_a, out_a, log_b = tmp_path / "a.log", tmp_path / "a.out", tmp_path / "b.log"
        with open(log_a, "wb") as la, open(out_a, "wb") as oa:
            a = subprocess.Popen(kvtier_cmd("serve", str(model), "--config", str(cfg_a), "--port", str(port_a),
                                            *VLLM_ARGS), env=base_env(cpu_a, tmp_a), cwd=REPO, stdout=oa,
                                 stderr=la, stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(a)
        with open(log_b, "wb") as lb:
            b = subprocess.Popen(["sh", "-c", line_b], env=env_b, cwd=REPO, stdout=lb,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(b)

        # The cache-off reference, while the servers start.
        def reference():
            spec = {"model": str(model), "kvtier": None,
                    "engine": {"enable_prefix_caching": False, "max_model_len": 640},
                    "phases": [{"name": "ref", "max_tokens": MAX_TOKENS, "one_by_one": True,
                                "prompts": [{"tokens": list(r.tokens)} for r in wl.phases[0].requests]}]}
            try:
                ref_out["run"] = run_engine(spec, tmp_path / "ref", "reference", env={"VLLM_CPU_OMP_THREADS_BIND": cpu_a})
            except BaseException as exc:  # re-raised on the test's thread
                ref_out["error"] = exc

        ref_thread = threading.Thread(target=reference)
        ref_thread.start()
        wait_healthy(url_a, a, log_a)
        wait_healthy(url_b, b, log_b)
        t_ready = time.monotonic()

        result = endpoint.run_workload(wl, [url_a, url_b], routing="workload")
        t_run = time.monotonic()
        ref_thread.join(timeout=START_TIMEOUT_S)
        if "error" in ref_out:
            raise ref_out["error"]
        reference_tokens = [r["tokens"] for r in ref_out["run"].phase("ref")]

        recs = {r["id"]: r for r in result["records"]}
        warm_on = {s: recs[f"s{s}-warm"]["endpoint"] for s in range(SESSIONS)}
        resume_on = {s: recs[f"s{s}-resume"]["endpoint"] for s in range(SESSIONS)}
        for s in range(SESSIONS):
            warm, resume = recs[f"s{s}-warm"], recs[f"s{s}-resume"]
            assert warm["cached_tokens"] == 0, f"session {s}: nothing can hit on its first serve"
            assert resume["cached_tokens"] == HIT, f"session {s} resumed on {resume['server']}: {resume}"
            assert warm["output"] == reference_tokens[s], f"session {s}: warm output differs from cache-off"
            assert resume["output"] == reference_tokens[s], f"session {s}: resumed output differs from cache-off"
            assert len(resume["output"]) == MAX_TOKENS

        resume_phase = result["phases"][1]
        for k, srv in enumerate(resume_phase["servers"]):
            summ = srv["summary"]
            here = [s for s in range(SESSIONS) if resume_on[s] == k]
            moved = [s for s in here if warm_on[s] != k]
            kvtier_hits = sum(summ["kvtier_hit_tokens_by_tier"].values())
            where = f"server {'AB'[k]} ({srv['endpoint']}), resumes {here}, moved {moved}: {summ}"
            assert summ["requests"] == len(here), where
            # Every cached token is vLLM's own or kvtier's; kvtier's are vLLM's external hits.
            assert summ["prefix_cache_hits"] + kvtier_hits == HIT * len(here), where
            assert kvtier_hits == summ["external_prefix_cache_hits"], where
            # Sessions warmed on the other server: vLLM never saw them here;
            # all their hits come from the shared directory.
            assert summ["kvtier_hit_tokens_by_tier"].get("shared", 0) >= HIT * len(moved) > 0, where
            if k == 1:
                assert set(summ["kvtier_hit_tokens_by_tier"]) == {"shared"}, where
                # What those loads cost in CPU, scraped as an operator would
                # (docs/metrics.md): the tier's threads and the loading thread.
                assert srv["metrics"].get("kvtier_io_cpu_seconds_total{kind=load,tier=shared}", 0) > 0, where
                assert srv["metrics"].get("kvtier_load_caller_cpu_seconds_total", 0) > 0, where
        warm_phase = result["phases"][0]
        for srv in warm_phase["servers"]:
            assert srv["summary"]["kvtier_hit_tokens_by_tier"] == {}, srv
            assert srv["metrics"].get("kvtier_vllm_saved_chunks_total", 0) > 0, f"kvtier's metrics on /metrics: {srv}"

        # The report of `kvtier bench resume --endpoint` matches an in-process
        # run of the same workload (W1, sessions nobody stored yet) in hit
        # tokens per tier: B has the shared tier alone and too few blocks to
        # keep a session, like the in-process kvtier-shared configuration.
        common = ("bench", "resume", "--workload", "w1", "--contexts", str(CONTEXT), "--sessions", "3",
                  "--model", "tiny-llama", "--seed", "1000", "--no-progress", "--load-decision", "always")
        ep = subprocess.run(kvtier_cmd(*common, "--endpoint", url_b, "--label", "server-b", "--dir",
                                       str(tmp_path / "ep"), "--json", str(tmp_path / "ep.json")),
                            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert ep.returncode == 0, ep.stdout[-2000:] + ep.stderr[-2000:]
        inproc = subprocess.run(kvtier_cmd(*common, "--configs", "kvtier-shared", "--no-fio", "--dir",
                                           str(tmp_path / "ip"), "--json", str(tmp_path / "ip.json")),
                                cwd=REPO, capture_output=True, text=True, timeout=600,
                                env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu_a})
        assert inproc.returncode == 0, inproc.stdout[-2000:] + inproc.stderr[-2000:]
        ep_res = json.loads((tmp_path / "ep.json").read_text())["results"][str(CONTEXT)]["server-b"]
        ip_res = json.loads((tmp_path / "ip.json").read_text())["results"][str(CONTEXT)]["kvtier-shared"]
        assert ep_res["hit_tokens"] == ip_res["hit_tokens"] == {"shared": 3 * HIT}, (ep_res, ip_res)
        assert ep_res["cached_tokens_p50"] == ip_res["cached_tokens_p50"] == HIT
        assert "per server" in ep.stdout and url_b in ep.stdout

        # kvtier serve: the line it printed first, then a clean stop on SIGTERM.
        printed = out_a.read_text().splitlines()[0]
        words_a = shlex.split(printed)
        prom_a = Path(words_a[0].split("=", 1)[1])
        private_a = prom_a.parent
        assert words_a[0].startswith("PROMETHEUS_MULTIPROC_DIR=") and private_a.parent == tmp_a, printed
        assert f"TMPDIR={private_a}" in words_a, printed
        assert prom_a.is_dir() and any(prom_a.glob("*.db"))
        family = psutil.Process(a.pid).children(recursive=True)
        assert len(family) >= 2, f"kvtier serve runs the API server and its engine: {family}"
        t_stop = time.monotonic()
        a.send_signal(signal.SIGTERM)
        rc = a.wait(timeout=90)
        stop_s = time.monotonic() - t_stop
        assert rc == 0, f"kvtier serve exited {rc}; log tail:\n{tail(log_a.read_text(errors='replace'))}"
        _, alive = psutil.wait_procs(family, timeout=5)
        assert not alive, f"stray processes after kvtier serve exited: {alive}"
        assert not private_a.exists(), "the server's private TMPDIR must be removed"
        left = [f.name for p in family for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{p.pid}_*")]
        assert not left, f"OpenMP registrations of the server's processes left in /dev/shm: {left}"
        assert sorted(p.name for p in tmp_a.iterdir()) == [], "kvtier serve and vLLM left temporary files"
        assert "stopping the server" in log_a.read_text(errors="replace")
        print(f"\nstart-up {t_ready - t_start:.1f} s, W3 run {t_run - t_ready:.1f} s, SIGTERM to exit {stop_s:.1f} s")
        for k, srv in enumerate(resume_phase["servers"]):
            summ = srv["summary"]
            print(f"resume on {'AB'[k]}: {srv['requests']} requests, kvtier hits by tier "
                  f"{summ['kvtier_hit_tokens_by_tier']}, vLLM prefix-cache hits {summ['prefix_cache_hits']:.0f}")
    finally:
        for p in procs:
            stop_group(p)
        shutil.rmtree(tmp_a, ignore_errors=True)
        shutil.rmtree(tmp_b, ignore_errors=True)
        shutil.rmtree(node_memory, ignore_errors=True)
