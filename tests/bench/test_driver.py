"""The client driver's sending rules (readiness, dependencies, think time,
the concurrency bound) and the workloads' shapes, against a backend that
serves each request in a fixed time (the driver's logic, no engine)."""

import time

import pytest

from kvtier.bench.driver import run_phase
from kvtier.bench.workloads import ChatShape, Phase, Request, Workload, hash_ids, w1, w2, w3


class TimedBackend:
    """Serves every request in ``service_s``; first token at half of it."""

    def __init__(self, service_s: float):
        self.service_s = service_s
        self.live: dict[str, float] = {}
        self.max_live = 0
        self.sent: list[tuple[str, float]] = []

    def send(self, request):
        now = time.perf_counter()
        self.live[request.id] = now
        self.sent.append((request.id, now))
        self.max_live = max(self.max_live, len(self.live))

    def poll(self, timeout_s):
        time.sleep(min(timeout_s, 0.002))
        now, events = time.perf_counter(), []
        for rid, t in list(self.live.items()):
            if now - t >= self.service_s:
                del self.live[rid]
                events += [("first", rid, t + self.service_s / 2), ("done", rid, now, {"tokens": [1, 2], "cached_tokens": 3})]
        return events


def test_concurrency_bound_and_records():
    reqs = tuple(Request(f"r{i}", i, 0, tuple(range(300)), 2) for i in range(6))
    be = TimedBackend(0.03)
    recs = run_phase(Phase("p", reqs, concurrency=2), be, block_tokens=128)
    assert be.max_live == 2
    assert sorted(r["id"] for r in recs) == [f"r{i}" for i in range(6)]
    for r in recs:
        assert r["prompt_tokens"] == 300 and r["output_tokens"] == 2 and r["cached_tokens"] == 3
        assert len(r["hash_ids"]) == 2 and r["block_tokens"] == 128
        assert 0 < r["ttft_s"] < r["t_done"] - r["t_send"] + 1e-9
    # Requests 3-6 queued behind the bound.
    assert max(r["queue_s"] for r in recs) >= 0.05


def test_dependencies_and_think_time():
    reqs = (
        Request("a0", 0, 0, (5,) * 10, 1),
        Request("a1", 0, 1, (5,) * 20, 1, after="a0", think_s=0.1),
        Request("b0", 1, 0, (6,) * 10, 1, at_s=0.05),
    )
    be = TimedBackend(0.02)
    recs = {r["id"]: r for r in run_phase(Phase("p", reqs, concurrency=4), be)}
    assert recs["a1"]["t_send"] >= recs["a0"]["t_done"] + 0.1 - 1e-3
    assert recs["b0"]["t_send"] >= 0.05 - 1e-3
    assert recs["a0"]["t_send"] < 0.02


def test_hash_ids_are_prefix_chained():
    a = list(range(1000))
    b = a[:512] + [7] * 488
    ha, hb = hash_ids(a, 256), hash_ids(b, 256)
    assert len(ha) == 3 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert hash_ids(a, 256) == ha  # deterministic


def test_workload_shapes_and_routing():
    one = w1(3, 512, 100)
    assert [p.name for p in one.phases] == ["warm", "resume"] and one.phases[1].cold
    assert [r.tokens for r in one.phases[0].requests] == [r.tokens for r in one.phases[1].requests]
    again = w1(2, 512, 100, resumes=3)
    assert [(p.name, p.cold, p.measured) for p in again.phases] == [
        ("warm", False, False), ("resume", True, True), ("resume-2", True, True), ("resume-3", True, True)]
    assert [r.id for r in again.phases[3].requests] == ["s0-resume-3", "s1-resume-3"]
    assert [r.turn for r in again.phases[2].requests] == [2, 2] and again.params["resumes"] == 3
    assert again.phases[3].requests[1].tokens == again.phases[0].requests[1].tokens
    with pytest.raises(ValueError, match="at least 2 sessions"):
        w1(1, 512, 100, resumes=2)  # the engine's own cache would serve the second resume
    three = w3(6, 256, 100, instances=3)
    parts = [three.for_instance(k) for k in range(3)]
    assert sum(len(p.phases[1].requests) for p in parts) == 6
    assert all(p.phases[0].concurrency == 1 for p in parts)
    chat = w2(ChatShape(sessions=3, turns=(3, 3), system_tokens=64), vocab=100, seed=1)
    by_session: dict = {}
    for r in chat.phases[0].requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.after == prev.id and nxt.tokens[: len(prev.tokens)] == prev.tokens  # history grows
        assert len({r.tokens[:64] for r in turns}) == 1  # the shared system prompt
    assert Workload.from_json(chat.to_json()) == chat
