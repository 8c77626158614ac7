"""Real vLLM engines for the end-to-end tests: tiny checkpoints and a runner.

Every engine is its own process (``python -m kvtier.bench.vllm_runner SPEC
OUT``): vLLM keeps global state, so two ``LLM`` objects never share a
process. Start-up dominates (~15 s each on 2 cores), so ``EnginePool`` runs up to
``KVTIER_TEST_ENGINES`` (default: one per CPU, at most 2) engine processes at
once, each with its OpenMP team pinned to a core of its own (vLLM's default
binds every engine to all cores, and two engines' spinning teams then slow
each other down several times over; a tiny model needs one thread). The
tests submit every run they need up front and then wait for results.

On failure the message carries the tail of the engine's log; the full log,
spec and output stay in pytest's temporary directory (path in the message).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[3]
ENGINE_TIMEOUT_S = 300  # one engine process, start-up included (normally 15-25 s)
LOG_TAIL_LINES = 60
LOG_LINE_CHARS = 400
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None

# vLLM needs these on this host (see /work/shared/VLLM_CPU.md): one process
# for scheduler and worker, and no attempt to reach the Hugging Face hub.
_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engine_runs(*names): vLLM engine runs a test reads (all are started ahead, a few at a time)"
    )


class EngineFailed(AssertionError):
    """An engine process failed (or succeeded where it should have failed)."""


@dataclass
class EngineRun:
    """One engine process: its spec, exit status, log and parsed output."""

    name: str
    spec: dict
    returncode: int
    log_path: Path
    out: dict | None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.log, lines)

    def phase(self, name: str) -> list[dict]:
        for p in self.out["phases"]:
            if p["name"] == name:
                return p["results"]
        raise KeyError(f"run {self.name} has no phase {name!r}: {[p['name'] for p in self.out['phases']]}")

    def only(self, phase: str) -> dict:
        results = self.phase(phase)
        assert len(results) == 1, f"{self.name}/{phase}: {len(results)} results"
        return results[0]

    def vllm_metric(self, name: str) -> float:
        """A vLLM metric (``vllm:...``) as the runner reports it; 0 if absent."""
        return float(self.out["metrics"].get(name, 0.0))

    def kvtier_metric(self, name: str, **labels: str) -> float:
        """One kvtier sample (``name{k=v,...}``); 0 if never touched."""
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        return float(self.out["kvtier_metrics"].get(key, 0.0))

    def kvtier_by_label(self, name: str, label: str = "tier") -> dict[str, float]:
        """``{label value: sample}`` over every sample of ``name`` (one label)."""
        out: dict[str, float] = {}
        for key, value in self.out["kvtier_metrics"].items():
            if key.startswith(name + "{") and key.endswith("}"):
                labels = dict(kv.split("=", 1) for kv in key[len(name) + 1 : -1].split(","))
                if label in labels:
                    out[labels[label]] = out.get(labels[label], 0.0) + float(value)
        return out

    def where(self) -> str:
        return f"engine run {self.name!r} (log {self.log_path})"


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines, each cut to a readable width (vLLM prints
    its whole config on one line)."""
    out = []
    for line in text.splitlines()[-lines:]:
        out.append(line if len(line) <= LOG_LINE_CHARS else line[:LOG_LINE_CHARS] + " [...]")
    return "\n".join(out)


def run_engine(spec: dict, workdir: Path, name: str, *, expect_failure: bool = False,
               timeout: float = ENGINE_TIMEOUT_S, env: dict[str, str] | None = None) -> EngineRun:
    """Write ``spec``, run one engine process on it, return what it wrote.

    Raises EngineFailed, with the tail of the engine's log, when the process
    fails (or, with ``expect_failure``, when it succeeds) or times out.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    if isinstance(spec.get("kvtier"), dict) and "load_decision" not in spec["kvtier"]:
        # These runs check which bytes come back and how many tokens hit; with
        # tiny models a tier loads a token about as fast as the engine computes
        # it, so under load_decision auto the hits would depend on timing.
        # The decision has tests of its own (test_costs.py, and a run on a
        # throttled mount that sets auto).
        spec = {**spec, "kvtier": {**spec["kvtier"], "load_decision": "always"}}
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    # kvtier reads KVTIER_* as configuration: keep the caller's out of the engine.
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env.update(_ENGINE_ENV)
    # The node's memory tier is shared by every process that opens its
    # folder: each run gets its own (a spec's node_memory_dir overrides it,
    # for runs that are meant to share one).
    node_memory = Path(tempfile.mkdtemp(prefix=f"kvtier-e2e-{name}-", dir=_SHM))
    env["KVTIER_NODE_MEMORY_DIR"] = str(node_memory)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_runner", str(spec_path), str(out_path)]
    try:
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:  # subprocess.run has killed it
                rc = None
    finally:
        shutil.rmtree(node_memory, ignore_errors=True)
    run = EngineRun(name, spec, -9 if rc is None else rc, log_path,
                    json.loads(out_path.read_text()) if rc == 0 and out_path.exists() else None)
    if rc is None:
        raise EngineFailed(f"{run.where()} timed out after {timeout:.0f} s; log tail:\n{run.log_tail()}")
    if expect_failure:
        if rc == 0:
            raise EngineFailed(f"{run.where()} started and ran, but was expected to fail; log tail:\n{run.log_tail()}")
    elif rc != 0 or run.out is None:
        raise EngineFailed(f"{run.where()} failed with exit status {rc}; log tail:\n{run.log_tail()}")
    return run


class EnginePool:
    """Runs engine processes in the background, one per free slot; a slot
    is a CPU the engine's OpenMP team is bound to.

    ``submit(fn)`` runs ``fn`` on a thread of its own (so that a task waiting
    for another task's result holds no slot); ``fn`` calls ``run``, which
    waits for a free slot around the process.
    """

    def __init__(self, workdir: Path, limit: int | None = None):
        self.workdir = workdir
        cpus = sorted(os.sched_getaffinity(0))
        limit = limit or min(2, len(cpus))
        self._slots: queue.Queue = queue.Queue()
        for i in range(max(1, limit)):
            self._slots.put(str(cpus[i % len(cpus)]))
        self._threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="e2e-engine")
        self._wide = threading.Lock()
        self.size = max(1, limit)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._threads.submit(fn, *args)

    def run(self, spec: dict, name: str, cpus: int = 1, env: dict[str, str] | None = None, **kw: Any) -> EngineRun:
        """Run one engine on ``cpus`` slots (a tensor-parallel engine needs
        one per rank: vLLM binds each rank's OpenMP team to its own CPU)."""
        with self._wide if cpus > 1 else contextlib.nullcontext():
            # One wide run gathers slots at a time: two could each hold one
            # and wait for the other's forever.
            held = [self._slots.get() for _ in range(min(cpus, self.size))]
        try:
            env = dict(env or {})
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # more ranks than slots: ranks share CPUs
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(held[i % len(held)] for i in range(cpus)))
            return run_engine(spec, self.workdir, name, env=env, **kw)
        finally:
            for cpu in held:
                self._slots.put(cpu)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    limit = os.environ.get("KVTIER_TEST_ENGINES")
    pool = EnginePool(tmp_path_factory.mktemp("vllm-e2e"), int(limit) if limit else None)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random-init fp32 checkpoints, built once per session (seconds)."""
    from kvtier.bench.tinymodels import build_checkpoint

    root = tmp_path_factory.mktemp("tinymodels")
    return {name: build_checkpoint(f"tiny-{name}", root / name) for name in ("llama", "qwen2")}
