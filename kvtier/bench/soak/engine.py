"""The soak engine process: serves the soak's requests in vLLM with kvtier
while an ``Injector`` damages the tiers' storage (``runner`` starts it).

    python -m kvtier.bench.soak.engine SPEC OUT

SPEC is the JSON the runner wrote (model, kvtier config, requests, faults,
the tiers' directories); OUT receives each request's tokens and top
logprobs, the faults injected and kvtier's metrics.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

from kvtier.bench.soak.faults import Injector

TOP_LOGPROBS = 5


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

    from kvtier.bench.vllm_runner import connector_config
    from kvtier.bench.worker_ext import WORKER_EXTENSION

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, max_model_len=4096,
              disable_log_stats=False, kv_transfer_config=connector_config(spec["kvtier"]),
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
    sys.exit(engine_main(sys.argv[1], sys.argv[2]))
