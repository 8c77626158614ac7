"""End to end with a cluster key, on the real engine (CPU build), at TP=1
and TP=2, both in vLLM's default multiprocess mode (the workers in processes
of their own, which get the key file through ``KVTIER_AUTH_KEY_FILE`` in
their environment, as an operator sets it).

- ``keyed-tp*``: a writer with the key on a shared tier: every object it
  stores is sealed, and its resumed prompts hit, token-exactly.
- ``forged-tp*``: a fresh engine with the key on a copy of that directory
  in which an attacker without the key replaced two objects: one forged
  (a well-formed object of its own, unsealed, checksums right), one
  tampered (a genuine object with a payload byte changed and its checksums
  fixed). Neither is served: the output is the cache-off run's, the refusals
  are counted by reason, and the recomputed chunks are stored again.

The model is the tiny Qwen2 checkpoint (2 KV heads: one per rank at TP=2).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from kvtier import auth
from kvtier.codec import HEADER_BLOCK, encode, parse_header
from kvtier.keys import ChunkKey
from kvtier.tiers.dir.files import ObjectDir
from tests.integrations.vllm.runs import Ctx, RunDef, runs_marker, start_runs
from tests.support import rechecksum
from tests.integrations.vllm.test_e2e import P, assert_same_output, phase_name
from tests.integrations.vllm.test_topology import (ENGINE, MODEL, MULTIPROCESS, ONE_PROCESS, _baseline, _namespace, _phase,
                                                   _shard_path)

pytestmark = pytest.mark.slow

PROMPTS = ["A", "B", "C"]
WRITE_RESUMES = [("A", None, 384), ("B", None, 640), ("C", None, 896)]
# On the forged copy: A's chunk 0 is forged (A loads nothing; once
# recomputed it is stored again, so A hits the second time); C's chunk 1 is
# tampered (C loads chunk 0 only); B is intact.
FORGED_RESUMES = [("A", None, None), ("C", None, None), ("B", None, 640), ("A", "again", 384)]


_KEY_LOCK = threading.Lock()  # runs start on the engine pool's threads, two at a time


def _key_env(c: Ctx, multiprocess: bool = True) -> dict[str, str]:
    path = c.dir("cluster.key")
    with _KEY_LOCK:
        if not path.exists():
            auth.write_key_file(str(path), [auth.new_key()])
    return {**(MULTIPROCESS if multiprocess else ONE_PROCESS), "KVTIER_AUTH_KEY_FILE": str(path)}


def _shared(c: Ctx, name: str) -> dict:
    return {"tiers": [{"kind": "shared", "path": str(c.dir(name)), "capacity": "64MiB"}]}


def _writer(tp: int) -> RunDef:
    def spec(c: Ctx) -> dict:
        c.dir(f"keyed-tp{tp}-shared").mkdir(parents=True, exist_ok=True)
        return {"model": str(c.models[MODEL]), "kvtier": _shared(c, f"keyed-tp{tp}-shared"),
                "engine": {**ENGINE, "tensor_parallel_size": tp},
                "phases": [_phase("warm", [(p, None) for p in PROMPTS], reset=False)]
                + [_phase(phase_name(p, s), [(p, s)]) for p, s, _ in WRITE_RESUMES]}
    return RunDef(spec, cpus=tp, env=_key_env)


def _forge(tp: int):
    def before(c: Ctx) -> None:
        src, dst = c.dir(f"keyed-tp{tp}-shared"), c.dir(f"forged-tp{tp}-shared")
        shutil.copytree(src, dst)
        ns = _namespace(c.logs[f"keyed-tp{tp}"].read_text())
        odir = ObjectDir(dst, "test")
        # A forgery: a well-formed, unsealed object of the attacker's own,
        # for the last rank's shard of A's chunk 0.
        forged = _shard_path(odir, ns, P["A"], 0, rank=tp - 1, tp=tp)
        h = parse_header(forged.read_bytes()[:HEADER_BLOCK])
        obj = encode(ChunkKey(h.key, h.check, h.ns, h.num_tokens), h.dtype, h.shape, os.urandom(h.payload_len))
        forged.write_bytes(bytes(obj.buf))
        # A tampered genuine object: rank 0's shard of C's chunk 1.
        tampered = _shard_path(odir, ns, P["C"], 1, rank=0, tp=tp)
        data = bytearray(tampered.read_bytes())
        data[HEADER_BLOCK + 1000] ^= 0xFF
        tampered.write_bytes(rechecksum(data))
        c.notes[f"forged-tp{tp}"] = {"paths": [forged, tampered], "size": len(data)}
    return before


def _reader(tp: int) -> RunDef:
    return RunDef(lambda c: {
        "model": str(c.models[MODEL]), "kvtier": _shared(c, f"forged-tp{tp}-shared"),
        "engine": {**ENGINE, "tensor_parallel_size": tp},
        "phases": [_phase(phase_name(p, s), [(p, None)]) for p, s, _ in FORGED_RESUMES],
    }, deps=(f"keyed-tp{tp}",), before=_forge(tp), cpus=tp, env=_key_env)


RUNS: dict[str, RunDef] = {
    "keyed-tp2": _writer(2),
    "forged-tp2": _reader(2),
    "base-tp2": _baseline(2, PROMPTS),
    "keyed-tp1": _writer(1),
    "forged-tp1": _reader(1),
    "base-tp1": _baseline(1, PROMPTS),
}


def engine_runs(*names: str):
    return runs_marker(RUNS, *names)


@pytest.fixture(scope="module")
def runs(request, engine_pool, tiny_models, tmp_path_factory):
    return start_runs(RUNS, request, engine_pool, tiny_models, tmp_path_factory)


TPS = [pytest.param(tp, marks=engine_runs(f"keyed-tp{tp}", f"forged-tp{tp}", f"base-tp{tp}"), id=f"tp{tp}")
       for tp in (1, 2)]


@pytest.mark.parametrize("tp", TPS)
def test_a_keyed_engine_seals_what_it_stores_and_hits_token_exactly(runs, tp):
    run = runs[f"keyed-tp{tp}"]
    assert assert_same_output(run, runs[f"base-tp{tp}"]) == len(PROMPTS) + len(WRITE_RESUMES)
    for p, s, n in WRITE_RESUMES:
        assert run.only(phase_name(p, s))["num_cached_tokens"] == n, f"{run.where()}, phase {phase_name(p, s)}"
    assert sum(run.kvtier_by_label("kvtier_auth_failures_total").values()) == 0, run.out["kvtier_metrics"]
    kid = auth.key_id(auth.read_key_file(str(runs.ctx.dir("cluster.key")))[0])
    objects = list((runs.ctx.dir(f"keyed-tp{tp}-shared") / "kvtier-v1" / "objects").rglob("*.kvc"))
    assert objects and all(parse_header(p.read_bytes()[:HEADER_BLOCK]).seal_key == kid for p in objects)


@pytest.mark.parametrize("tp", TPS)
def test_objects_planted_without_the_key_are_not_served(runs, tp):
    run = runs[f"forged-tp{tp}"]
    assert assert_same_output(run, runs[f"base-tp{tp}"]) == len(FORGED_RESUMES)
    metrics = run.out["kvtier_metrics"]
    assert run.kvtier_metric("kvtier_auth_failures_total", tier="shared", reason=auth.UNSEALED) >= 1, metrics
    assert run.kvtier_metric("kvtier_auth_failures_total", tier="shared", reason=auth.BAD_SEAL) >= 1, metrics
    assert run.kvtier_metric("kvtier_vllm_load_failed_blocks_total") > 0, metrics
    assert run.only("B")["num_cached_tokens"] == 640, run.where()
    # A was recomputed and stored again in place of the forgery: it hits now.
    assert run.only("A@again")["num_cached_tokens"] == 384, run.where()
    forged = runs.ctx.notes[f"forged-tp{tp}"]
    for p in forged["paths"]:
        h = parse_header(Path(p).read_bytes()[:HEADER_BLOCK])
        assert h.seal_key != auth.UNSEALED_ID, f"{p} was not stored again, sealed"
