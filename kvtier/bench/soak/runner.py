"""The soak's runner: builds the model and the request stream, runs the
reference and the soak engine processes one after the other, and judges the
soak engine's answers against the reference (``report``).

Two engine processes run one after the other (never at once), the same tiny
random-init fp32 model in both (greedy output depends on every bit of KV):

1. reference: no kvtier, no prefix cache: what every request must answer
   (``--reference salted`` instead computes each prompt from scratch in the
   soak engine itself, before any fault, under a fresh cache salt: one
   engine start less, which the CI test uses).
2. soak (``engine``): kvtier with memory, disk and shared tiers (and Redis
   when it can be started). Before each request vLLM's own prefix cache is
   reset (and now and then kvtier's memory tier is emptied), so resumed
   prefixes come from the disk and shared tiers, or are recomputed. A few
   faults are injected before each request, and meanwhile a thread in the
   engine process injects more at random (``faults.FAULTS``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.bench.soak.engine import TOP_LOGPROBS
from kvtier.bench.soak.faults import FAULTS
from kvtier.bench.soak.report import judge
from kvtier.errors import ConfigError

VOCAB_LOW = 3  # token ids 0-2 are pad/bos/eos in tinymodels

# ---------------------------------------------------------------- the request stream


def make_stream(sessions: int, requests: int, seed: int, vocab: int) -> list[list[int]]:
    """Resumed sessions: each request continues a random session (a longer
    prompt: the previous one plus new user tokens) or repeats its last one."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randrange(300, 700))] for _ in range(sessions)]
    out = []
    for _ in range(requests):
        s = rng.randrange(sessions)
        if rng.random() < 0.7 and len(prompts[s]) < 2400:
            prompts[s] = prompts[s] + [rng.randrange(VOCAB_LOW, vocab) for _ in range(rng.randrange(40, 300))]
        out.append(list(prompts[s]))
    return out


# ---------------------------------------------------------------- the parent

# A soak empties its working directory first: only one it made itself
# (this file marks it), or an empty one.
SOAK_MARK = ".kvtier-soak"


def run(workdir: Path, requests: int = 60, sessions: int = 5, seed: int = 0, fault_rate: float = 8.0,
        max_tokens: int = 8, reference: str = "engine", faults: tuple[str, ...] = tuple(FAULTS), faults_per_request: int = 2,
        timeout_s: float = 900, log=print) -> dict:
    """Both runs; returns the report (``report.judge``).

    ``reference="engine"``: the reference is a separate engine process with
    kvtier and the prefix cache off. ``"salted"`` (one engine start less, for
    CI): the soak engine itself computes every prompt first, before any fault,
    each under a fresh cache salt so that neither vLLM nor kvtier can reuse
    anything: every token from scratch."""
    from kvtier.bench.tinymodels import PRESETS, build_checkpoint

    workdir = Path(workdir).resolve()
    if workdir.exists():
        if any(workdir.iterdir()) and not (workdir / SOAK_MARK).is_file():
            raise ConfigError("--dir", f"{workdir} is not empty and was not made by kvtier bench soak",
                              "pass a new or empty directory (or one an earlier soak made); the soak empties it")
        _unmount_below(workdir)
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / SOAK_MARK).write_text("made by kvtier bench soak; emptied by the next soak in this folder\n")
    model = build_checkpoint("tiny-llama", workdir / "model")
    stream = make_stream(sessions, requests, seed, PRESETS["tiny-llama"][6])
    unique = sorted({tuple(p) for p in stream}, key=lambda p: (len(p), p))

    log(f"soak: {requests} requests over {sessions} sessions ({len(unique)} distinct prompts), seed {seed}; "
        f"engine logs in {workdir}")
    t0 = time.monotonic()
    if reference == "engine":
        ref_spec = {
            "model": str(model), "kvtier": None, "engine": {"enable_prefix_caching": False},
            "phases": [{"name": "reference", "prompts": [{"tokens": list(p)} for p in unique],
                        "max_tokens": max_tokens, "logprobs": TOP_LOGPROBS, "one_by_one": True}],
        }
        ref = _engine(workdir, "reference", ref_spec, ["-m", "kvtier.bench.vllm_runner"], timeout_s)
        expected = {tuple(p): r for p, r in zip(unique, ref["phases"][0]["results"], strict=True)}
        log(f"soak: reference run done ({time.monotonic() - t0:.0f} s)")
    elif reference != "salted":
        raise ValueError(f"reference must be 'engine' or 'salted', not {reference!r}")

    mounted, redis = [], None
    # The node memory tier of this soak alone (it is shared by whatever opens its folder).
    node_memory = tempfile.mkdtemp(prefix="kvtier-soak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    dirs = {"disk": workdir / "disk", "shared": workdir / "shared"}
    for name, size in (("disk", "48m"), ("shared", "96m")):
        dirs[name].mkdir()
        if _mount_tmpfs(dirs[name], size):
            mounted.append(name)
    try:
        (dirs["shared"] / "store").mkdir()  # a shared tier's folder must exist, as a mount point does
        tiers = [
            {"kind": "memory", "capacity": "4MiB"},
            {"kind": "disk", "path": str(dirs["disk"] / "store"), "capacity": "24MiB"},
            {"kind": "shared", "path": str(dirs["shared"] / "store"), "capacity": "48MiB"},
        ]
        redis_skip = None
        if "redis-stall" in faults:
            redis, redis_skip = _start_redis(workdir / "redis")
            if redis is not None:
                tiers.insert(2, {"kind": "redis", "address": f"127.0.0.1:{redis[1]}", "capacity": "32MiB",
                                 "socket_timeout_s": 0.5, "connect_timeout_s": 0.5})
        spec = {
            "model": str(model),
            "kvtier": {"tiers": tiers, "breaker_cooldown_s": 1.0, "node_memory_dir": node_memory},
            "redis_pid": redis[0].pid if redis is not None else None, "redis_skip": redis_skip,
            "requests": stream, "max_tokens": max_tokens, "seed": seed, "fault_rate": fault_rate, "faults": list(faults),
            "faults_per_request": faults_per_request,
            "reference": [list(p) for p in unique] if reference == "salted" else [],
            "dirs": {k: str(v) for k, v in dirs.items()}, "tmpfs": mounted, "outside": str(workdir / "outside"),
        }
        t1 = time.monotonic()
        out = _engine(workdir, "soak", spec, ["-m", "kvtier.bench.soak.engine"], timeout_s)
        log(f"soak: faulted run done ({time.monotonic() - t1:.0f} s)")
    finally:
        if redis is not None:
            redis[0].kill()  # SIGKILL stops a stopped (SIGSTOPped) process too
            redis[0].wait(10)
        _unmount_below(workdir)
        shutil.rmtree(node_memory, ignore_errors=True)

    if reference == "salted":
        expected = {tuple(p): r for p, r in zip(unique, out["reference"], strict=True)}
    return judge(stream, expected, out, reference, mounted, time.monotonic() - t0)


def _engine(workdir: Path, name: str, spec: dict, module: list[str], timeout_s: float) -> dict:
    from kvtier.bench.engine_env import engine_env

    spec_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in engine_env().items() if not k.startswith("KVTIER_")}
    with open(log_path, "wb") as f:
        try:
            proc = subprocess.run([sys.executable, *module, str(spec_path), str(out_path)], stdout=f,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the {name} engine timed out after {timeout_s:.0f} s; log: {log_path}") from None
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the {name} engine failed (exit {proc.returncode}); end of {log_path}:\n{tail}")
    return json.loads(out_path.read_text())


def _start_redis(workdir: Path):
    """A redis-server on a free loopback port, no persistence: (process,
    port), or (None, why not)."""
    import socket

    exe = shutil.which("redis-server")
    try:
        import redis  # noqa: F401  (the tier's client)
    except ImportError:
        return None, "redis-stall: redis-py is not installed (pip install 'kvtier[redis]')"
    if exe is None:
        return None, "redis-stall: redis-server is not installed"
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--protected-mode", "yes", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return (proc, port), None
        except OSError:
            time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    return None, "redis-stall: redis-server did not start"


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True)
    return proc.returncode == 0


def _unmount_below(root: Path) -> None:
    root = str(Path(root).resolve())
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f]
    except OSError:
        return
    for p in sorted((p for p in points if p.startswith(root + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], capture_output=True)

