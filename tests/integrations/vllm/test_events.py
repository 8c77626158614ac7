"""kvtier's tiers in vLLM's KV events, end to end: a real engine started
with ``--kv-events-config`` (ZMQ publisher on loopback) and a real ZMQ
subscriber here decoding vLLM's msgspec batches.

One engine (tiny Llama, fp32, memory + disk + shared tiers, the memory tier
four chunks large) runs, one phase each, every phase after the first
waiting for the write-through of the ones before (so that their events
come with its steps):

    A       1024 tokens: 4 chunks saved
    B       another 1024 tokens: its chunks push A's out of memory
    S       600 tokens under cache_salt "alice"
    C       a short prompt, whose steps carry what B and S left
    A2      A + 300 tokens, vLLM's own prefix cache reset first: served by kvtier

and checks that the stored events name exactly the blocks vLLM's own GPU
events name for the same tokens (hashes, parent, tokens, extra keys), per
tier with its medium, locality and ownership; that eviction from memory
publishes BlockRemoved; and that replaying the events into a prefix index
predicts A2's hit exactly. In process, in vLLM's default multiprocess mode
and at TP=2.
"""

from __future__ import annotations

import random
import sys
import socket
import threading
import time
from collections import defaultdict

import pytest

from kvtier.bench.tinymodels import PRESETS
from kvtier.routing.index import PrefixIndex
from tests.integrations.vllm.runs import Ctx, RunDef, runs_marker, start_runs

VOCAB = PRESETS["tiny-llama"][6]
BLOCK = 128  # vLLM's block size on CPU
CHUNK = 256


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P = {"A": toks(101, 1024), "B": toks(102, 1024), "S": toks(103, 600), "C": toks(104, 200)}
P["A2"] = P["A"] + toks(105, 300)
PHASES = [("A", None, False), ("B", None, False), ("S", "alice", False), ("C", None, False), ("A2", None, True)]
# Then another process collects the whole shared tier (``kvtier store gc``),
# and a phase long enough for the scheduler to read the removal journal
# (C, 200 tokens, and 48 more: no chunk fills, so nothing new is stored).
GC_WAIT_S = 6  # past the journal's read interval (events.JOURNAL_INTERVAL_S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A ZMQ SUB socket, decoding every batch with vLLM's own types, on a
    thread of its own. It binds and the engine's publisher connects (vLLM
    binds an endpoint with ``*`` in it and connects to any other): the
    test listens on loopback only.""" 

    def __init__(self, endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(endpoint)
        self.errors: list[str] = []
        self.batches: list = []  # (seq, batch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _topic, seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                self.batches.append((int.from_bytes(seq, "big"), self._decoder.decode(payload)))
            except Exception as exc:  # reported by the test
                self.errors.append(repr(exc))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def _spec(tp: int, label: str):
    def spec(c: Ctx) -> dict:
        port = free_port()
        shared = c.dir(f"{label}-shared")
        shared.mkdir(parents=True, exist_ok=True)
        c.notes.setdefault("subscribers", {})[port] = Subscriber(f"tcp://127.0.0.1:{port}")
        c.notes.setdefault("ports", {})[spec] = port
        return {
            "model": str(c.models["llama"]),
            "kvtier": {"tiers": [
                # Four chunks of tiny Llama (256 KiB of fp32 KV each, and a
                # header); under vLLM the node's memory, shared by the ranks.
                "memory://?capacity=1100KiB",
                {"kind": "disk", "path": str(c.dir(f"{label}-disk")), "capacity": "64MiB"},
                {"kind": "shared", "path": str(shared), "capacity": "64MiB"},
            ]},
            "engine": {"tensor_parallel_size": tp, "kv_events_config": {
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}},
            "phases": [{"name": name, "prompts": [{"tokens": P[name], "salt": salt}], "max_tokens": 2,
                        "flush": i > 0, "reset_prefix_cache": reset}
                       for i, (name, salt, reset) in enumerate(PHASES)] + [{
                "name": "gc", "prompts": [{"tokens": P["C"], "salt": None}], "max_tokens": 48, "flush": True,
                "command": [sys.executable, "-m", "kvtier.cli", "store", "gc", "--dir", str(shared),
                            "--capacity", "1KiB", "--yes"],
                "sleep_s": GC_WAIT_S}],
        }
    return spec


RUNS: dict[str, RunDef] = {
    "events": RunDef(_spec(1, "events")),
    "events-mp": RunDef(_spec(1, "events-mp"), env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
    "events-tp2": RunDef(_spec(2, "events-tp2"), cpus=2, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
}


@pytest.fixture(scope="module")
def runs(request, engine_pool, tiny_models, tmp_path_factory):
    r = start_runs(RUNS, request, engine_pool, tiny_models, tmp_path_factory)

    def close():
        for sub in r.ctx.notes.get("subscribers", {}).values():
            sub.close()
    request.addfinalizer(close)
    return r


def _events(runs, name: str):
    run = runs[name]
    port = runs.ctx.notes["ports"][RUNS[name].spec]
    sub = runs.ctx.notes["subscribers"][port]
    deadline = time.time() + 10
    last = run.out["phases"][-1]["ended"]
    while time.time() < deadline and not any(b.ts >= last - 1 for _, b in sub.batches):
        time.sleep(0.2)
    assert not sub.errors, sub.errors
    return run, sub.batches


def _blocks_of(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BLOCK]) for i in range(0, len(tokens) // BLOCK * BLOCK, BLOCK)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=runs_marker(RUNS, n), id=n) for n in RUNS])
def test_tier_events_name_vllms_blocks_and_predict_the_next_hit(runs, name):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    run, batches = _events(runs, name)
    phases = {p["name"]: p for p in run.out["phases"]}
    seqs = [s for s, _ in batches]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    gpu: dict = {}  # vLLM's own: block hash -> (parent, tokens, extra keys)
    stored = defaultdict(list)  # tier -> its BlockStored events, in order
    removed = defaultdict(set)  # tier -> hashes removed before the collection
    collected = set()  # shared-tier hashes removed after it
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.ownership is None:
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    gpu[h] = (parent, tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]),
                              (ev.extra_keys or [None] * len(ev.block_hashes))[i])
                    parent = h
            elif isinstance(ev, BlockStored):
                stored[ev.ownership].append(ev)
            elif isinstance(ev, BlockRemoved) and ev.ownership == "shared" and batch.ts >= phases["gc"]["started"]:
                collected.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.ownership is not None:
                removed[ev.ownership].update(ev.block_hashes)

    # Every tier published every whole block of every prompt, in vLLM's own
    # terms: the GPU event of the same block has the same hash, parent,
    # tokens and extra keys (cache_salt on S's first block).
    want = {b for n in ("A", "B", "S") for b in _blocks_of(P[n])}
    places = {"memory": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"), "shared": ("STORAGE", "REMOTE")}
    for tier, (medium, locality) in places.items():
        seen = set()
        for ev in stored[tier]:
            assert (ev.medium, ev.locality, ev.block_size) == (medium, locality, BLOCK), ev
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                toks_i = tuple(ev.token_ids[i * BLOCK : (i + 1) * BLOCK])
                extra = (ev.extra_keys or [None] * len(ev.block_hashes))[i]
                assert gpu.get(h) == (parent, toks_i, extra), f"{tier}: block {i} of {ev} differs from vLLM's"
                parent = h
                seen.add(toks_i)
        assert want <= seen, f"{tier}: {len(want - seen)} blocks never published"
    s_first = next(h for h, v in gpu.items() if v[1] == _blocks_of(P["S"])[0])
    assert gpu[s_first][2] == ("alice",)

    # The memory tier holds four chunks: B's pushed A's out, and said so.
    a_hashes = {h for h, v in gpu.items() if v[1] in set(_blocks_of(P["A"]))}
    assert a_hashes and a_hashes <= removed["memory"]
    assert not removed["disk"] and not removed["shared"]

    # A router's prefix index (kvtier.routing), replayed from the events up
    # to A2's phase, vLLM's own prefix cache then reset as the engine does
    # it, predicts A2's hit: the blocks kvtier's tiers hold.
    index = PrefixIndex(instances=1)
    for _, batch in batches:
        if batch.ts < phases["A2"]["started"]:
            index.apply(0, batch.events)
    index.clear_gpu(0)
    (predicted,) = index.predict(P["A2"])
    hit = phases["A2"]["results"][0]["num_cached_tokens"]
    assert predicted.tokens == hit == 1024, (predicted, hit)
    # vLLM counted it as the connector's: every cached token after A2's reset was.
    after_reset = hit + phases["gc"]["results"][0]["num_cached_tokens"]
    assert run.vllm_metric("vllm:external_prefix_cache_hits") == after_reset
    assert {s.holding.ownership for s in predicted.segments} <= {"disk", "shared"}  # memory: evicted

    # Another process emptied the shared tier: its removal journal told
    # this engine, which took back every block it had published there.
    published = {h for ev in stored["shared"] for h in ev.block_hashes}
    where = {h: next((n for n in P if v[1] in set(_blocks_of(P[n]))), "?") for h, v in gpu.items()}
    assert collected == published, {
        "not taken back": sorted(where.get(h, "?") for h in published - collected),
        "taken back, never published": sorted(where.get(h, "?") for h in collected - published)}
    assert run.kvtier_metric("kvtier_vllm_kv_events_total", tier="shared", kind="stored") > 0
