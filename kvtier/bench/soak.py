"""``kvtier bench soak``: a real engine serves resumed sessions while the
storage under kvtier is damaged at random.

Two engine processes run one after the other (never at once), the same tiny
random-init fp32 model in both (greedy output depends on every bit of KV):

1. reference: no kvtier, no prefix cache: what every request must answer
   (``--reference salted`` instead computes each prompt from scratch in the
   soak engine itself, before any fault, under a fresh cache salt: one
   engine start less, which the CI test uses).
2. soak: kvtier with memory, disk and shared tiers. Before each request vLLM's
   own prefix cache is reset (and now and then kvtier's memory tier is
   emptied), so resumed prefixes come from the disk and shared tiers, or are
   recomputed. A few faults are injected before each request, and meanwhile
   a thread in the engine process injects more at random into those tiers'
   directories, concurrently with loads and saves:

   flip         one byte of an object (header or payload)
   truncate     an object cut short
   zero         an object emptied
   delete       an object removed behind kvtier's back
   version      an object rewritten with another format version
   swap         an object's bytes replaced by another chunk's (foreign KV)
   symlink      an object replaced by a link to a foreign object outside
   symlink-dir  a fan-out folder replaced by a link to a copy outside
   fifo         an object replaced by a FIFO
   vanish       the shared directory's layout taken away for a while
   fill         the disk tier's file system filled for a while (needs a
                tmpfs, so root; reported as skipped otherwise)
   redis-stall  the Redis server stopped (SIGSTOP) for a while: a hung
                backend (with a Redis tier, when redis-server and redis-py
                are installed; reported as skipped otherwise)

The report: requests served, faults injected by kind, wrong-token requests
(against the reference; must be 0), failed requests (must be 0), changes
outside the store (the copies the links point to; must be 0), and what kvtier
counted (integrity failures, blocks recomputed after a failed load, dropped
saves, hit tokens). Exit status 1 if any must-be-0 figure is not.

    python -m kvtier.bench.soak --engine SPEC OUT     (the soak engine process)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from kvtier.errors import ConfigError

FAULTS = ("flip", "truncate", "zero", "delete", "version", "swap", "symlink", "symlink-dir", "fifo", "vanish", "fill",
          "redis-stall")
REFERENCES = {
    "engine": "a separate engine, kvtier and prefix cache off",
    "salted": "the same engine before any fault, a fresh cache salt per prompt",
}
MUST_BE_ZERO = ("wrong_requests", "off_logprob_requests", "failed_requests", "outside_changed")
TOP_LOGPROBS = 5
LOGPROB_TOL = 1e-3  # as the end-to-end tests: same tokens, same top logprobs within this
VOCAB_LOW = 3  # token ids 0-2 are pad/bos/eos in tinymodels
CHUNK = 256


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
        max_tokens: int = 8, reference: str = "engine", faults: tuple[str, ...] = FAULTS, faults_per_request: int = 2,
        timeout_s: float = 900, log=print) -> dict:
    """Both runs; returns the report (see ``format_report``).

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
        out = _engine(workdir, "soak", spec, ["-m", "kvtier.bench.soak", "--engine"], timeout_s)
        log(f"soak: faulted run done ({time.monotonic() - t1:.0f} s)")
    finally:
        if redis is not None:
            redis[0].kill()  # SIGKILL stops a stopped (SIGSTOPped) process too
            redis[0].wait(10)
        _unmount_below(workdir)
        shutil.rmtree(node_memory, ignore_errors=True)

    if reference == "salted":
        expected = {tuple(p): r for p, r in zip(unique, out["reference"], strict=True)}
    wrong, off = [], []
    for i, (p, r) in enumerate(zip(stream, out["results"])):
        if r["error"] is None:
            exp = expected[tuple(p)]
            if r["tokens"] != exp["tokens"]:
                wrong.append(i)
            elif _logprob_gap(r["logprobs"], exp["logprobs"]) > LOGPROB_TOL:
                off.append(i)
    failed = [i for i, r in enumerate(out["results"]) if r["error"] is not None]
    km = out["kvtier_metrics"]
    report = {
        "reference": reference,
        "requests": requests,
        "served": len(out["results"]) - len(failed),
        "failed_requests": len(failed),
        "wrong_requests": len(wrong),
        "off_logprob_requests": len(off),
        "faults": out["faults"],
        "faults_total": sum(out["faults"].values()),
        "faults_skipped": out["skipped"],
        "outside_changed": len(out["outside_changed"]),
        "memory_drops": out["memory_drops"],
        "prompt_tokens": sum(len(p) for p in stream),
        "kvtier_hit_tokens": _sum(km, "kvtier_vllm_external_hit_tokens_total"),
        "kvtier_integrity_failures": _sum(km, "kvtier_integrity_failures_total"),
        "blocks_recomputed_after_failed_load": _sum(km, "kvtier_vllm_load_failed_blocks_total"),
        "dropped_saves": _sum(km, "kvtier_dropped_saves_total"),
        "backend_errors": _sum(km, "kvtier_errors_total"),
        "seconds": time.monotonic() - t0,
        "details": {"wrong": wrong[:20], "off_logprobs": off[:20], "failed": [out["results"][i]["error"] for i in failed[:20]],
                    "outside_changed": out["outside_changed"][:20], "tmpfs": mounted},
    }
    report["ok"] = all(report[k] == 0 for k in MUST_BE_ZERO) and report["served"] == requests
    return report


def _logprob_gap(got: list[dict], want: list[dict]) -> float:
    """The largest difference of a top logprob both runs report, any step."""
    gap = 0.0
    for g, w in zip(got, want):
        for tok in set(g) & set(w):
            gap = max(gap, abs(g[tok] - w[tok]))
    return gap


def _sum(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


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


def format_report(r: dict) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()) if v)
    lines = [
        "kvtier soak: resumed sessions in a real engine while its storage is damaged",
        "",
        f"requests served          {r['served']} of {r['requests']}",
        f"faults injected          {r['faults_total']} ({faults})",
    ]
    if r["faults_skipped"]:
        lines.append(f"faults skipped           {'; '.join(r['faults_skipped'])}")
    lines += [
        f"memory tier emptied      {r['memory_drops']} times",
        f"wrong tokens             {r['wrong_requests']} requests (must be 0)",
        f"logprobs off by > {LOGPROB_TOL:g}  {r['off_logprob_requests']} requests with the right tokens (must be 0)",
        f"failed requests          {r['failed_requests']} (must be 0)",
        f"changes outside store    {r['outside_changed']} (must be 0)",
        f"kvtier hit tokens        {r['kvtier_hit_tokens']:.0f} of {r['prompt_tokens']} prompt tokens",
        f"integrity failures       {r['kvtier_integrity_failures']:.0f} (counted, quarantined, recomputed)",
        f"blocks recomputed        {r['blocks_recomputed_after_failed_load']:.0f} (promised, then failed to load)",
        f"saves dropped            {r['dropped_saves']:.0f}",
        f"backend errors           {r['backend_errors']:.0f}",
        f"reference                {REFERENCES[r['reference']]}",
        f"time                     {r['seconds']:.0f} s",
        "",
        "OK" if r["ok"] else "FAILED: " + json.dumps(r["details"]),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def register(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
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
    p.add_argument("--faults", type=_kinds, default=FAULTS,
                   help=f"fault kinds to inject, comma-separated (default all: {','.join(FAULTS)})")
    p.add_argument("--reference", choices=sorted(REFERENCES), default="engine",
                   help="engine: a separate cache-off engine run (default); salted: the soak engine computes each "
                        "prompt from scratch first, under a fresh cache salt (one engine start less)")
    p.add_argument("--json", help="also write the report to this JSON file")
    p.set_defaults(func=_cmd)


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault kind {unknown[0]!r}; known: {', '.join(FAULTS)}")
    return kinds


def _cmd(args: argparse.Namespace) -> int:
    report = run(Path(args.dir), requests=args.requests, sessions=args.sessions, seed=args.seed,
                 fault_rate=args.fault_rate, reference=args.reference, faults=args.faults,
                 faults_per_request=args.faults_per_request)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


# ---------------------------------------------------------------- the soak engine process


class Injector:
    """Damages the disk and shared tiers' directories at random, on its own
    thread, while the engine serves. Timed faults (vanish, fill, links) are
    undone after a while; ``stop`` undoes what is left."""

    def __init__(self, dirs: dict[str, Path], tmpfs: list[str], outside: Path, rate: float, seed: int,
                 kinds: tuple[str, ...] = FAULTS, redis_pid: int | None = None, redis_skip: str | None = None):
        self.kinds = [k for k in kinds if not (k == "fill" and "disk" not in tmpfs)
                      and not (k == "redis-stall" and redis_pid is None)]
        self.redis_pid = redis_pid
        self._redis_stopped = False
        self.dirs = dirs
        self.tmpfs = tmpfs
        self.outside = outside
        self.rate = rate
        self.rng = random.Random(seed)
        self.counts = {k: 0 for k in FAULTS}
        self.skipped: list[str] = []
        if "fill" in kinds and "disk" not in tmpfs:
            self.skipped.append("fill: the disk tier is not on a tmpfs this process could mount (needs root)")
        if redis_skip:
            self.skipped.append(redis_skip)
        self._heals: list[tuple[float, callable]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next: list[int] | None = None
        self._ns: dict[str, bytes] = {}
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._traps: list[tuple[Path, dict]] = []  # outside copies and their snapshot
        self._n = 0
        outside.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for _, heal in self._heals:
                heal()
            self._heals.clear()

    def outside_changes(self) -> list[str]:
        changed = []
        for root, snap in self._traps:
            now = _snapshot(root)
            if now != snap:
                changed.append(f"{root}: {sorted(set(now) ^ set(snap)) or 'contents changed'}")
        return changed

    # -------------------------------------------------------- loop
    def _run(self) -> None:
        while not self._stop.wait(self.rng.expovariate(self.rate) if self.rate > 0 else 3600):
            self.inject_one()

    def inject_one(self, kind: str | None = None) -> None:
        """One fault now, random unless ``kind`` is given (from the
        injector's thread, or between requests by the serving loop); due
        heals first."""
        with self._lock:
            now = time.monotonic()
            for item in [h for h in self._heals if h[0] <= now]:
                self._heals.remove(item)
                item[1]()
            if not self.kinds:
                return
            if kind is None or kind not in self.kinds:
                kind = self.rng.choice(self.kinds)
            try:
                if getattr(self, "_" + kind.replace("-", "_"))():
                    self.counts[kind] += 1
            except (OSError, ValueError):
                pass  # the file went away meanwhile (kvtier evicted or quarantined it): not injected

    def _objects(self, tier: str | None = None) -> list[Path]:
        tiers = [tier] if tier else list(self.dirs)
        out = []
        for t in tiers:
            objects = self.dirs[t] / "store" / "kvtier-v1" / "objects"
            # Not through a folder link this injector planted: the copies
            # outside are the evidence that kvtier never writes there.
            out += [p for p in objects.glob("*/*/*.kvc")
                    if not p.parent.is_symlink() and p.is_file() and not p.is_symlink()]
        return out

    def _tier(self) -> str:
        # Mostly the disk tier: loads ask it before the shared tier, so its
        # objects are the ones read.
        return "disk" if self.rng.random() < 0.7 else "shared"

    def _pick(self, tier: str | None = None) -> Path | None:
        """An object to damage: half of the time one the next request will
        ask for (if the tier holds any), else any."""
        tier = tier or self._tier()
        objs = self._targets(tier) if self.rng.random() < 0.5 else []
        objs = objs or self._objects(tier)
        return self.rng.choice(objs) if objs else None

    def target(self, tokens: list[int]) -> None:
        """The prompt the engine serves next: faults aim at its chunks too."""
        with self._lock:
            self._next = tokens

    def _targets(self, tier: str) -> list[Path]:
        """The objects of the next prompt's full chunks this tier holds. Their
        names need the namespace digest, which any object's header echoes:
        tried per namespace folder (reference runs use other salts)."""
        from kvtier.codec import HEADER_STRUCT_SIZE, parse_header
        from kvtier.keys import next_key, root_key

        objects = self.dirs[tier] / "store" / "kvtier-v1" / "objects"
        tokens = self._next or []
        for folder in sorted(objects.glob("*")):
            ns = self._ns.get(folder.name)
            if ns is None:
                sample = next((p for p in folder.glob("*/*.kvc") if not p.parent.is_symlink() and p.is_file()), None)
                try:
                    with open(sample, "rb") as f:
                        ns = self._ns[folder.name] = parse_header(f.read(HEADER_STRUCT_SIZE)).ns
                except Exception:  # none yet, or damaged: try again later
                    continue
            key, found = root_key(ns), []
            for start in range(0, len(tokens) - CHUNK + 1, CHUNK):
                key = next_key(key, tokens[start : start + CHUNK])
                h = key.digest.hex()
                p = folder / h[:2] / f"{h}.kvc"
                if not p.parent.is_symlink() and p.is_file() and not p.is_symlink():
                    found.append(p)
            if found:
                return found
        return []

    def _later(self, seconds: float, heal) -> None:
        self._heals.append((time.monotonic() + seconds, heal))

    # -------------------------------------------------------- faults
    def _flip(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        size = p.stat().st_size
        pos = self.rng.randrange(size) if self.rng.random() < 0.7 else self.rng.randrange(min(size, 216))
        with open(p, "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ (1 << self.rng.randrange(8))]))
        return True

    def _truncate(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        os.truncate(p, self.rng.randrange(1, p.stat().st_size))
        return True

    def _zero(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        os.truncate(p, 0)
        return True

    def _delete(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        p.unlink()
        return True

    def _version(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        data = bytearray(p.read_bytes())
        if len(data) < 216:
            return False
        struct.pack_into("<H", data, 8, self.rng.choice((0, 2, 7)))
        struct.pack_into("<I", data, 212, zlib.crc32(bytes(data[:212])))
        _replace(p, bytes(data))
        return True

    def _swap(self) -> bool:
        tier = self._tier()
        b = self._pick(tier)
        if b is None:
            return False
        size = b.stat().st_size  # same size: same shape, so that only the key check can tell
        others = [p for p in self._objects(tier) if p != b and p.stat().st_size == size]
        if not others:
            return False
        _replace(b, self.rng.choice(others).read_bytes())  # b's name, another chunk's KV
        return True

    def _symlink(self) -> bool:
        objs = self._objects()
        if len(objs) < 2:
            return False
        a, b = self.rng.sample(objs, 2)
        trap = self._trap()
        target = trap / "foreign.kvc"
        target.write_bytes(a.read_bytes())
        self._seal(trap)
        tmp = b.with_name(b.name + ".link")
        os.symlink(target, tmp)
        os.replace(tmp, b)
        return True

    def _symlink_dir(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        fan = p.parent
        trap = self._trap()
        copy = trap / fan.name
        shutil.copytree(fan, copy, symlinks=True)
        self._seal(trap)
        aside = fan.with_name(fan.name + ".soak-aside")
        os.rename(fan, aside)
        os.symlink(copy, fan)

        def heal():
            try:
                if fan.is_symlink():
                    os.unlink(fan)
                if not fan.exists():
                    os.rename(aside, fan)
                else:
                    shutil.rmtree(aside, ignore_errors=True)
            except OSError:
                pass

        self._later(self.rng.uniform(0.5, 2.0), heal)
        return True

    def _fifo(self) -> bool:
        p = self._pick()
        if p is None:
            return False
        tmp = p.with_name(p.name + ".fifo")
        os.mkfifo(tmp, 0o600)
        os.replace(tmp, p)
        return True

    def _vanish(self) -> bool:
        base = self.dirs["shared"] / "store" / "kvtier-v1"
        away = base.with_name("kvtier-v1.soak-away")
        if not base.exists() or away.exists():
            return False
        os.rename(base, away)

        def heal():
            try:
                if base.exists():  # something recreated it meanwhile: keep both, ours wins
                    shutil.rmtree(base)
                os.rename(away, base)
            except OSError:
                pass

        self._later(self.rng.uniform(0.3, 1.5), heal)
        return True

    def _fill(self) -> bool:
        filler = self.dirs["disk"] / f"filler.{self._n}"
        self._n += 1
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\1" * (1 << 16)):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        self._later(self.rng.uniform(0.3, 1.5), lambda: filler.unlink(missing_ok=True))
        return True

    def _redis_stall(self) -> bool:
        if self._redis_stopped:
            return False
        os.kill(self.redis_pid, signal.SIGSTOP)
        self._redis_stopped = True

        def heal():
            os.kill(self.redis_pid, signal.SIGCONT)
            self._redis_stopped = False

        self._later(self.rng.uniform(0.3, 1.5), heal)
        return True

    def _trap(self) -> Path:
        self._n += 1
        trap = self.outside / f"trap-{self._n}"
        trap.mkdir()
        return trap

    def _seal(self, trap: Path) -> None:
        self._traps.append((trap, _snapshot(trap)))


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".soak")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (p.read_bytes() if p.is_file() and not p.is_symlink() else b"", st.st_mtime_ns)
    return out


def _result(out) -> dict:
    c = out.outputs[0]
    return {"tokens": list(c.token_ids), "cached": out.num_cached_tokens, "error": None,
            "logprobs": [{str(t): float(v.logprob) for t, v in step.items()} for step in (c.logprobs or [])]}


def _empty_memory_tiers(llm) -> None:
    llm.collective_rpc("kvtier_flush", args=(30,))
    llm.collective_rpc("kvtier_clear", args=(["memory"],))


def engine_main(spec_path: str, out_path: str) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(Path(spec_path).read_text())
    from prometheus_client import REGISTRY
    from vllm import LLM, SamplingParams

    from kvtier.bench.vllm_runner import _connector_config
    from kvtier.bench.worker_ext import WORKER_EXTENSION

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, max_model_len=4096,
              disable_log_stats=False, kv_transfer_config=_connector_config(spec["kvtier"]),
              worker_extension_cls=WORKER_EXTENSION)
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, logprobs=TOP_LOGPROBS)
    rng = random.Random(spec["seed"] + 1)
    injector = Injector({k: Path(v) for k, v in spec["dirs"].items()}, spec["tmpfs"], Path(spec["outside"]),
                        spec["fault_rate"], spec["seed"] + 2, tuple(spec["faults"]), spec["redis_pid"],
                        spec["redis_skip"])
    results, drops, reference = [], 0, []
    for tokens in spec["reference"]:  # before any fault; a fresh salt: nothing to reuse
        llm.reset_prefix_cache()
        salt = os.urandom(16).hex()
        out = llm.generate([{"prompt_token_ids": tokens, "cache_salt": salt}], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0, "a salted reference request reused KV"
        reference.append(_result(out))
    _empty_memory_tiers(llm)
    injector.start()
    try:
        for tokens in spec["requests"]:
            llm.reset_prefix_cache()  # the prefix comes from kvtier or is recomputed
            injector.target(tokens)
            for i in range(spec["faults_per_request"]):  # besides the thread's, whatever the engine's speed
                # Foreign KV under a valid name is what only the key check
                # stops: half of the time the first fault is a swap (aimed, as
                # half of all faults are, at a chunk this request asks for).
                injector.inject_one("swap" if i == 0 and rng.random() < 0.5 else None)
            if rng.random() < 0.5:
                _empty_memory_tiers(llm)
                drops += 1
            try:
                out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
                results.append(_result(out))
            except Exception as exc:  # counted as a failed request
                results.append({"tokens": None, "cached": 0, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        injector.stop()
    llm.collective_rpc("kvtier_flush", args=(30,))
    kv = {}
    for fam in REGISTRY.collect():
        if fam.name.startswith("kvtier"):
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    kv[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    Path(out_path).write_text(json.dumps({
        "results": results, "reference": reference, "faults": injector.counts, "skipped": injector.skipped, "memory_drops": drops,
        "outside_changed": injector.outside_changes(), "kvtier_metrics": kv,
    }))
    del llm
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--engine":
        sys.exit(engine_main(sys.argv[2], sys.argv[3]))
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.soak")
    register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args()
    sys.exit(args.func(args))
