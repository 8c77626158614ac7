"""End to end in vLLM's other process topologies: tensor parallel 2, and
vLLM's default multiprocess mode (the worker in a process of its own), on
the real engine (CPU build), no mocks.

The model is the tiny Qwen2 checkpoint (fp32, random init) with 2 KV heads:
at TP=2 each rank holds one head, so a rank that read the other rank's
shard would change the output. Every output is compared with a cache-off
run of the same TP size, tokens equal and top logprobs within 1e-3.

Runs (prompts as in test_e2e.py; vLLM's KV cache forced to 12 blocks):

- ``tp2-write`` (TP=2, multiprocess): memory, disk and shared tiers; hits
  from each tier in turn (the faster tiers emptied through the workers),
  tenant salts, then B again so that it stays in the node's memory.
- ``tp2-reader`` (TP=2, one engine process + workers): a fresh engine on a
  copy of the writer's shared directory in which one rank's shard of three
  chunks is damaged: a payload byte flipped, an object cut short, an
  object deleted.
- ``mp-write`` (TP=1, multiprocess): the same phases as ``tp2-write``, its
  memory tier in a node folder that ``mp-node-b``, a second engine process
  with an empty disk tier of its own, then opens: it resumes what the first
  left in the node's memory.
- ``tp1-from-tp2``, ``tp2-from-tp1``: an engine of the other TP size on a
  copy of a writer's shared directory assembles its shards from the
  writer's.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from kvtier.codec import HEADER_BLOCK
from kvtier.keys import next_key, root_key, shard_key
from kvtier.tiers.dir.files import ObjectDir
from tests.integrations.vllm.runs import Ctx, RunDef, runs_marker, start_runs
from tests.integrations.vllm.test_e2e import (
    CHUNK, MAX_TOKENS, P, TOP_LOGPROBS, assert_same_output, external_hits_by_tier, phase_name,
)

pytestmark = pytest.mark.slow

MODEL = "qwen2"
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Small enough that vLLM itself keeps little; B2 (1000 tokens + 8) fits.
ENGINE = {"num_gpu_blocks_override": 12, "max_model_len": 10 * 128, "kv_cache_memory_bytes": 64 << 20}
NODE_MEMORY_CAPACITY = 4 << 20
PROMPTS = ["A", "B", "C", "S", "A2", "B2", "D"]

# (prompt, salt, tiers dropped before it, expected num_cached_tokens, tier that serves it)
WRITE_RESUMES = [
    ("A", None, [], 384, "memory"), ("B", None, [], 640, "memory"),
    ("C", None, ["memory"], 896, "disk"),
    ("A2", None, ["memory", "disk"], 512, "shared"), ("B2", None, ["memory", "disk"], 640, "shared"),
    ("S", "bob", [], 0, None), ("S", None, [], 0, None),
    ("S", "alice", ["memory", "disk"], 512, "shared"),
    ("D", None, [], 512, "shared"),  # C's chunks left memory and disk with the drop before S@alice
    ("B", None, [], 640, "shared"),  # last: B stays in the node's memory for mp-node-b
]
# The reader, on a copy of tp2-write's shared directory with one rank's
# shard damaged: C chunk 1 (rank 1, a flipped byte), B chunk 0 (rank 0, cut
# short), A chunk 1 (rank 1, deleted).
READER_RESUMES = [
    ("C", None, None), ("B", None, None),
    ("A", None, 256),  # chunk 1 lacks rank 1's shard: only chunk 0 is a hit
    ("D", None, 768),  # C's chunk 1 stored again after its failed load; D's chunk 2 from the writer
    ("S", "carol", 0), ("S", "alice", 512),  # (the writer stored S under alice and bob)
    ("A2", None, 768),  # A's chunk 1 stored again; A2's chunk 2 from the writer
]
NODE_B_RESUMES = [("B", None, 640), ("S", "alice", 512)]


def _phase(name, prompts, drop=(), reset=True) -> dict:
    return {"name": name, "prompts": [{"tokens": P[p], "salt": s} for p, s in prompts],
            "max_tokens": MAX_TOKENS, "logprobs": TOP_LOGPROBS, "one_by_one": True,
            "reset_prefix_cache": reset, "drop_tiers": list(drop)}


def _resumes(rows) -> list[dict]:
    return [_phase(phase_name(p, s), [(p, s)], drop) for p, s, drop, *_ in rows]


def _tiers(c: Ctx, run: str, with_disk: bool = True, shared: str | None = None) -> list:
    tiers: list = [{"kind": "memory", "capacity": f"{NODE_MEMORY_CAPACITY}B"}]
    if with_disk:
        tiers.append({"kind": "disk", "path": str(c.dir(f"{run}-disk")), "capacity": "64MiB"})
    if shared:
        c.dir(shared).mkdir(parents=True, exist_ok=True)  # a shared tier's folder must exist (a mount point)
        tiers.append({"kind": "shared", "path": str(c.dir(shared)), "capacity": "64MiB"})
    return tiers


def _baseline(tp: int, prompts=PROMPTS) -> RunDef:
    """A cache-off run of ``prompts`` at TP size ``tp``, in one process."""
    return RunDef(lambda c: {
        "model": str(c.models[MODEL]), "kvtier": None,
        "engine": {**ENGINE, "enable_prefix_caching": False, "tensor_parallel_size": tp},
        "phases": [_phase("all", [(n, None) for n in prompts], reset=False)],
    }, cpus=tp, env=ONE_PROCESS)


def _writer(run: str, tp: int, node_memory: str | None = None) -> RunDef:
    def spec(c: Ctx) -> dict:
        kv: dict = {"tiers": _tiers(c, run, shared=f"{run}-shared")}
        if node_memory:
            if node_memory not in c.notes:
                c.notes[node_memory] = _node_dir(node_memory)
            kv["node_memory_dir"] = c.notes[node_memory]
        return {"model": str(c.models[MODEL]), "kvtier": kv,
                "engine": {**ENGINE, "tensor_parallel_size": tp},
                "phases": [_phase("warm", [("A", None), ("B", None), ("C", None), ("S", "alice")], reset=False)]
                + _resumes(WRITE_RESUMES)}
    return RunDef(spec, cpus=tp, env=MULTIPROCESS, after=_snapshot if tp == 2 else None)


def _node_dir(name: str) -> str:
    path = Path("/dev/shm") / f"kvtier-topology-{os.getpid()}-{name}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return str(path)


def _snapshot(c: Ctx) -> None:
    shutil.copytree(c.dir("tp2-write-shared"), c.dir("tp2-damaged"))


def _namespace(log: str) -> bytes:
    found = set(re.findall(r"kvtier: workers' pages \S+; namespace ([0-9a-f]{64})", log))
    assert len(found) == 1, f"expected the scheduler's namespace line once, found {found}"
    return bytes.fromhex(found.pop())


def _shard_path(odir: ObjectDir, ns: bytes, tokens: list[int], chunk: int, rank: int, tp: int) -> Path:
    key = root_key(ns)
    for i in range(chunk + 1):
        key = next_key(key, tokens[i * CHUNK : (i + 1) * CHUNK])
    return odir.path(shard_key(key, rank, tp))


def _damage(c: Ctx) -> None:
    ns = _namespace(c.logs["tp2-write"].read_text())
    d = c.dir("tp2-damaged")
    odir = ObjectDir(d, "test")
    flip = _shard_path(odir, ns, P["C"], 1, rank=1, tp=2)
    size = flip.stat().st_size
    with open(flip, "r+b") as f:
        f.seek(HEADER_BLOCK + 1000)
        b = f.read(1)
        f.seek(HEADER_BLOCK + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    cut = _shard_path(odir, ns, P["B"], 0, rank=0, tp=2)
    os.truncate(cut, cut.stat().st_size // 2)
    gone = _shard_path(odir, ns, P["A"], 1, rank=1, tp=2)
    gone.unlink()
    # The other rank's shards of those chunks are intact: only one rank's
    # shard is bad in each.
    for other in (_shard_path(odir, ns, P["C"], 1, 0, 2), _shard_path(odir, ns, P["B"], 0, 1, 2),
                  _shard_path(odir, ns, P["A"], 1, 0, 2)):
        assert other.stat().st_size == size
    c.notes["damaged"] = {"paths": [flip, cut], "size": size}


def _reader() -> RunDef:
    return RunDef(lambda c: {
        "model": str(c.models[MODEL]),
        "kvtier": {"tiers": [{"kind": "memory", "capacity": f"{NODE_MEMORY_CAPACITY}B"},
                             {"kind": "shared", "path": str(c.dir("tp2-damaged")), "capacity": "64MiB"}]},
        "engine": {**ENGINE, "tensor_parallel_size": 2},
        "phases": [_phase(phase_name(p, s), [(p, s)]) for p, s, _ in READER_RESUMES],
    }, deps=("tp2-write",), before=_damage, cpus=2, env=ONE_PROCESS)


def _node_b() -> RunDef:
    return RunDef(lambda c: {
        "model": str(c.models[MODEL]),
        "kvtier": {"tiers": _tiers(c, "mp-node-b"), "node_memory_dir": c.notes["mp-node"]},
        "engine": ENGINE,
        "phases": [_phase(phase_name(p, s), [(p, s)]) for p, s, _ in NODE_B_RESUMES],
    }, deps=("mp-write",), env=MULTIPROCESS)


CROSS_RESUMES = [("A", None, 384), ("B", None, 640), ("C", None, 896)]


def _cross(run: str, src: str, tp: int) -> RunDef:
    """A fresh engine of another TP size on a copy of ``src``'s shared
    directory: it finds no shard of its own TP size and assembles its shards
    from the writer's."""
    def copy(c: Ctx) -> None:
        shutil.copytree(c.dir(f"{src}-shared"), c.dir(f"{run}-shared"))

    return RunDef(lambda c: {
        "model": str(c.models[MODEL]),
        "kvtier": {"tiers": [{"kind": "shared", "path": str(c.dir(f"{run}-shared")), "capacity": "64MiB"}]},
        "engine": {**ENGINE, "tensor_parallel_size": tp},
        "phases": [_phase(phase_name(p, s), [(p, s)]) for p, s, _ in CROSS_RESUMES],
    }, deps=(src,), before=copy, cpus=tp, env=ONE_PROCESS)


RUNS: dict[str, RunDef] = {
    "tp2-baseline": _baseline(2),
    "tp2-write": _writer("tp2-write", 2),
    "tp2-reader": _reader(),
    "tp1-baseline": _baseline(1),
    "mp-write": _writer("mp-write", 1, node_memory="mp-node"),
    "mp-node-b": _node_b(),
    "tp1-from-tp2": _cross("tp1-from-tp2", "tp2-write", 1),
    "tp2-from-tp1": _cross("tp2-from-tp1", "mp-write", 2),
}


def engine_runs(*names: str):
    return runs_marker(RUNS, *names)


@pytest.fixture(scope="module")
def runs(request, engine_pool, tiny_models, tmp_path_factory):
    r = start_runs(RUNS, request, engine_pool, tiny_models, tmp_path_factory)
    yield r
    if "mp-node" in r.ctx.notes:
        shutil.rmtree(r.ctx.notes["mp-node"], ignore_errors=True)


# ------------------------------------------------------------------ checks


def _expected_by_tier(rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for *_, n, tier in rows:
        if tier:
            out[tier] = out.get(tier, 0) + n
    return out


def _assert_cached(run, rows) -> None:
    """Each phase's num_cached_tokens; rows are (prompt, salt, ..., expected, tier)."""
    got = {phase_name(p, s): run.only(phase_name(p, s))["num_cached_tokens"] for p, s, *_ in rows}
    want = {phase_name(p, s): n for p, s, _, n, _ in rows}
    assert got == want, f"{run.where()}: num_cached_tokens per phase"


@pytest.mark.parametrize("name,base,tp", [
    pytest.param("tp2-write", "tp2-baseline", 2, marks=engine_runs("tp2-write", "tp2-baseline"), id="tp2"),
    pytest.param("mp-write", "tp1-baseline", 1, marks=engine_runs("mp-write", "tp1-baseline"), id="tp1-multiprocess"),
])
def test_hits_from_every_tier_are_token_exact(runs, name, base, tp):
    """Memory, disk and shared hits, aligned and unaligned prompts, tenant
    salts: cache-off output, each hit from the tier that held it, and
    kvtier's claims equal vLLM's external hits."""
    run = runs[name]
    assert assert_same_output(run, runs[base]) == 4 + len(WRITE_RESUMES)
    _assert_cached(run, WRITE_RESUMES)
    want = _expected_by_tier(WRITE_RESUMES)
    assert external_hits_by_tier(run) == want, f"{run.where()}: {run.out['kvtier_metrics']}"
    assert run.vllm_metric("vllm:external_prefix_cache_hits") == sum(want.values()), run.where()
    # Memory hits were served without a disk read: the disk served C alone
    # (each rank reads its own shard of it).
    assert run.kvtier_metric("kvtier_hit_tokens_total", tier="disk") == want["disk"] * tp, run.where()
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") == 0, run.where()


@engine_runs("tp2-write")
def test_tp2_ranks_store_separate_shards(runs):
    """Every chunk of the TP=2 writer is two objects: as many shard objects
    of rank 0 as of rank 1, and each object's header names its own shard."""
    run = runs["tp2-write"]
    odir = ObjectDir(runs.ctx.dir("tp2-write-shared"), "test")
    ns = _namespace(run.log)
    for name in ("A", "B", "C"):
        for chunk in range(2):
            paths = [_shard_path(odir, ns, P[name], chunk, r, 2) for r in (0, 1)]
            assert all(p.exists() for p in paths), f"{name} chunk {chunk}: {paths}"
            assert paths[0] != paths[1]
            assert paths[0].read_bytes()[HEADER_BLOCK:] != paths[1].read_bytes()[HEADER_BLOCK:], (
                "both ranks stored the same KV: the heads did not split across ranks")


@engine_runs("tp2-reader", "tp2-baseline")
def test_one_ranks_damaged_shard_is_recomputed(runs):
    """One rank's shard of a chunk flipped, cut short or deleted: output as
    cache-off, the failures counted, the damaged objects quarantined, the
    deleted chunk not claimed at all."""
    run = runs["tp2-reader"]
    assert assert_same_output(run, runs["tp2-baseline"]) == len(READER_RESUMES)
    for p, s, n in READER_RESUMES:
        if n is not None:
            assert run.only(phase_name(p, s))["num_cached_tokens"] == n, f"{run.where()}, phase {phase_name(p, s)}"
    assert run.kvtier_metric("kvtier_integrity_failures_total", tier="shared") >= 2, run.out["kvtier_metrics"]
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") > 0, run.out["kvtier_metrics"]
    assert run.vllm_metric("vllm:external_prefix_cache_hits") == sum(external_hits_by_tier(run).values())
    damaged = runs.ctx.notes["damaged"]
    quarantine = sorted(q.name.split(".")[0] for q in
                        ObjectDir(runs.ctx.dir("tp2-damaged"), "test").quarantine_dir.iterdir())
    assert quarantine == sorted(p.stem for p in damaged["paths"]), run.where()
    for p in damaged["paths"]:
        assert p.stat().st_size == damaged["size"], f"{p} was not stored again"


@engine_runs("mp-node-b", "tp1-baseline")
def test_second_engine_resumes_from_the_nodes_memory(runs):
    """A second engine process on the node resumes what the first left in
    the node's memory tier: memory hits, no disk read (its own disk tier is
    empty and never served), cache-off output; the node's folder never holds
    more than the capacity."""
    run = runs["mp-node-b"]
    assert assert_same_output(run, runs["tp1-baseline"]) == len(NODE_B_RESUMES)
    for p, s, n in NODE_B_RESUMES:
        assert run.only(phase_name(p, s))["num_cached_tokens"] == n, f"{run.where()}, phase {phase_name(p, s)}"
    assert external_hits_by_tier(run) == {"memory": sum(n for *_, n in NODE_B_RESUMES)}, run.out["kvtier_metrics"]
    assert run.kvtier_metric("kvtier_hit_tokens_total", tier="disk") == 0
    held = sum(p.stat().st_size for p in Path(runs.ctx.notes["mp-node"]).rglob("*") if p.is_file()
               and p.suffix in (".kvc", ".tmp"))
    assert 0 < held <= NODE_MEMORY_CAPACITY, f"the node's memory tier holds {held} B"


@pytest.mark.parametrize("name,base", [
    pytest.param("tp1-from-tp2", "tp1-baseline", marks=engine_runs("tp1-from-tp2", "tp1-baseline"), id="tp2-to-tp1"),
    pytest.param("tp2-from-tp1", "tp2-baseline", marks=engine_runs("tp2-from-tp1", "tp2-baseline"), id="tp1-to-tp2"),
])
def test_a_store_written_at_one_tp_size_serves_another(runs, name, base):
    """What a TP=2 engine stored serves a TP=1 engine (its shards are
    assembled from both ranks' heads), and the reverse (each rank cuts its
    heads from the TP=1 object): the same hits, cache-off output of the
    reader's own TP size."""
    run = runs[name]
    assert assert_same_output(run, runs[base]) == len(CROSS_RESUMES)
    for p, s, n in CROSS_RESUMES:
        assert run.only(phase_name(p, s))["num_cached_tokens"] == n, f"{run.where()}, phase {phase_name(p, s)}"
    assert run.kvtier_metric("kvtier_vllm_assembled_chunks_total") > 0, run.out["kvtier_metrics"]
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") == 0, run.out["kvtier_metrics"]
