"""Run vLLM (offline ``LLM``) with or without kvtier, as one process per engine.

    python -m kvtier.bench.vllm_runner SPEC.json OUT.json

SPEC: {"model": dir, "kvtier": {kv_connector_extra_config} | null,
       "engine": {extra LLM(...) keyword arguments},
       "phases": [{"name": str, "prompts": [{"tokens": [...], "salt": str|null}],
                   "max_tokens": int, "logprobs": int, "one_by_one": bool,
                   "reset_prefix_cache": bool, "drop_tiers": [tier names],
                   "drop_page_cache": bool, "wait_for": path}]}
OUT:  {"phases": [{"name", "results": [{"tokens", "logprobs", "num_cached_tokens", "ttft_s"}]}],
       "metrics": {name: value}, "kvtier_metrics": {...}}

Or, instead of "phases", a workload (``kvtier.bench.workloads``) served
through the client driver, requests added to the engine as the workload says
(arrivals, think time, concurrency) and the engine stepped in between:

SPEC: {..., "workload": Workload.to_json(), "block_tokens": int,
       "cold": {"drop_tiers": [...], "drop_page_cache": bool},
       "barrier": dir | null, "instance": int}
OUT:  {"records": [driver records], "phases": [{"name", "t_start", "t_end"}], "metrics", "kvtier_metrics"}

With "barrier", the engine waits before each phase until DIR/go-<phase> exists
(after writing DIR/ready-<phase>-<instance>): instances of a multi-instance
run start each phase together, once their engines are loaded and the previous
phase is done everywhere. Phase times are ``time.time()`` so that runs of
several processes line up.

Prompts are token ids (no tokenizer is loaded). TTFT here is measured as the
wall time of a request generated alone with max_tokens=1 when ``one_by_one``
and ``max_tokens == 1``; otherwise it is the request's own
``metrics.first_token_latency`` when vLLM reports it.

``wait_for`` pauses the engine before a phase until the file ``path`` exists
(at most ``wait_timeout_s``, default 300 s; then the run fails). The runner
first creates ``path + ".reached"``, so that a test knows the engine is idle
there and can act between phases (kill or restart a storage server).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def connector_config(extra: dict) -> dict:
    return {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _drop_tiers(llm, names, drop_page_cache: bool) -> None:
    """Empty the named kvtier tiers (so that the next phase is served by a
    lower tier), and optionally drop the persistent tiers' files from the
    page cache (so that their reads are cold). Runs in every worker, through
    vLLM's collective_rpc: the workers may be processes of their own."""
    if not names and not drop_page_cache:
        return
    _rpc(llm, "kvtier_flush")
    if names:
        _rpc(llm, "kvtier_clear", list(names))
    if drop_page_cache:
        _rpc(llm, "kvtier_drop_page_cache")


def _quiesce(llm) -> None:
    """Let the warm-up's writes finish before a measured phase: kvtier's
    write-through, then the page cache's write-back (os.sync), so that no
    configuration's measurement pays for its own or another's leftover
    writes (a disk tier's files are not otherwise flushed; on a 2-core host
    the write-back of a few hundred MiB costs tens of ms of TTFT)."""
    _rpc(llm, "kvtier_flush")
    os.sync()


def _rpc(llm, method: str, *args):
    if not getattr(llm, "_kvtier", False):
        return []
    return llm.collective_rpc(method, args=args)


def _collect_kvtier_metrics() -> dict:
    """kvtier's samples from every process of the engine (prometheus_client's
    multiprocess files: the engine core and the workers may be processes of
    their own). Gauges carry one sample per process: the largest is kept."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg)
    kv: dict = {}
    for fam in reg.collect():
        if not fam.name.startswith("kvtier"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "pid")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            kv[key] = max(kv.get(key, s.value), s.value) if "pid" in s.labels else s.value
    return kv


def _vllm_metrics(llm) -> dict:
    """vLLM's prefix-cache counters, by name (and labels)."""
    metrics = {}
    for m in llm.get_metrics():
        if "prefix_cache" in m.name or "prompt_tokens_cached" in m.name:
            value = getattr(m, "value", None)
            if value is not None:
                labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("model_name", "engine"))
                metrics[f"{m.name}{{{labels}}}" if labels else m.name] = value
    return metrics


def _wait_for(path: str, timeout_s: float) -> None:
    open(path + ".reached", "w").close()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"wait_for: {path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.05)


class EngineBackend:
    """The driver's backend for an in-process engine: ``send`` adds a request,
    ``poll`` runs one engine step (the driver's thread is the engine's)."""

    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.started: set[str] = set()

    def send(self, request) -> None:
        from vllm import SamplingParams

        # ignore_eos: answers have the workload's length whatever the weights.
        sp = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        self.engine.add_request(request.id, {"prompt_token_ids": list(request.tokens)}, sp)

    def poll(self, timeout_s: float) -> list[tuple]:
        if not self.engine.has_unfinished_requests():
            time.sleep(timeout_s)
            return []
        outs = self.engine.step()
        t = time.perf_counter()
        events = []
        for o in outs:
            c = o.outputs[0]
            if c.token_ids and o.request_id not in self.started:
                self.started.add(o.request_id)
                events.append(("first", o.request_id, t))
            if o.finished:
                self.started.discard(o.request_id)
                events.append(("done", o.request_id, t,
                               {"tokens": list(c.token_ids), "cached_tokens": o.num_cached_tokens or 0}))
        return events


def _drop_dir_cache(directory: Path) -> None:
    """Drop every file under ``directory`` from the page cache (another
    connector's store, so that its reads are as cold as kvtier's)."""
    for p in directory.rglob("*"):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _barrier(directory: str | None, phase: str, instance: int) -> None:
    if not directory:
        return
    d = Path(directory)
    (d / f"ready-{phase}-{instance}").touch()
    while not (d / f"go-{phase}").exists():
        time.sleep(0.01)


def _run_workload(llm, spec: dict) -> dict:
    from kvtier.bench.driver import run_phase
    from kvtier.bench.workloads import Workload

    wl = Workload.from_json(spec["workload"])
    backend = EngineBackend(llm)
    cold = spec.get("cold", {})
    records, phases = [], []
    for phase in wl.phases:
        if phase.cold:
            _quiesce(llm)
            _drop_tiers(llm, cold.get("drop_tiers", ()), cold.get("drop_page_cache", False))
            for d in cold.get("drop_page_cache_dirs", ()):
                _drop_dir_cache(Path(d))
            # The sessions it resumes are evicted from the engine too, even
            # where its KV capacity holds every one of them (a burst of
            # sessions that all ran a moment before).
            llm.reset_prefix_cache()
        _barrier(spec.get("barrier"), phase.name, spec.get("instance", 0))
        t_start = time.time()
        recs = run_phase(phase, backend, block_tokens=spec.get("block_tokens", 256))
        # Counters as they stand after each phase: a phase's own figures are
        # the difference from the phase before.
        phases.append({"name": phase.name, "t_start": t_start, "t_end": time.time(),
                       "metrics": _vllm_metrics(llm), "kvtier_metrics": _collect_kvtier_metrics()})
        for r in recs:
            r["instance"] = spec.get("instance", r["instance"])
        records += recs
    return {"records": records, "phases": phases}


def main(spec_path: str, out_path: str) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = json.loads(open(spec_path).read())
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Before prometheus_client is imported anywhere: every process of
        # the engine (it inherits this) writes its samples there.
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvtier-runner-metrics-")
    from vllm import LLM, SamplingParams

    from kvtier.bench.worker_ext import WORKER_EXTENSION

    engine = dict(
        skip_tokenizer_init=True, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
        kv_cache_memory_bytes=64 << 20, max_model_len=4096, disable_log_stats=False,
    )
    engine.update(spec.get("engine", {}))
    if spec.get("kvtier") is not None:
        engine["kv_transfer_config"] = connector_config(spec["kvtier"])
        engine["worker_extension_cls"] = WORKER_EXTENSION
    llm = LLM(model=spec["model"], **engine)
    llm._kvtier = spec.get("kvtier") is not None
    out = _run_workload(llm, spec) if "workload" in spec else {"phases": []}
    for phase in spec.get("phases", ()):
        sp = SamplingParams(
            max_tokens=phase.get("max_tokens", 4), temperature=0.0, detokenize=False,
            logprobs=phase.get("logprobs"),
        )
        if phase.get("wait_for"):
            _wait_for(phase["wait_for"], phase.get("wait_timeout_s", 300))
        if phase.get("flush"):
            _rpc(llm, "kvtier_flush")  # the write-through of earlier phases lands first
        if phase.get("command"):
            # Another process acts first, as an operator would (e.g. ``kvtier store gc``).
            subprocess.run(phase["command"], check=True, stdin=subprocess.DEVNULL)
        time.sleep(phase.get("sleep_s", 0))
        if phase.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        started = time.time()
        _drop_tiers(llm, phase.get("drop_tiers", ()), phase.get("drop_page_cache", False))
        prompts = []
        for p in phase["prompts"]:
            d = {"prompt_token_ids": p["tokens"]}
            if p.get("salt"):
                d["cache_salt"] = p["salt"]
            prompts.append(d)
        results = []
        batches = [[p] for p in prompts] if phase.get("one_by_one", True) else [prompts]
        for batch in batches:
            t0 = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            for o in outs:
                c = o.outputs[0]
                lps = None
                if c.logprobs is not None:
                    lps = [{str(t): float(v.logprob) for t, v in step.items()} for step in c.logprobs]
                results.append({
                    "tokens": list(c.token_ids), "logprobs": lps,
                    "num_cached_tokens": o.num_cached_tokens, "wall_s": wall,
                })
        out["phases"].append({"name": phase.get("name", ""), "results": results, "started": started,
                              "ended": time.time()})
    out["metrics"] = _vllm_metrics(llm)
    kv = _collect_kvtier_metrics()
    out["kvtier_metrics"] = kv
    with open(out_path, "w") as f:
        json.dump(out, f)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
