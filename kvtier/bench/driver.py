"""The client side of a benchmark: send a phase's requests as the workload
says, whatever serves them.

A ``Backend`` serves requests and reports events; the driver decides *when*
each request is sent (readiness, dependencies, think time, the concurrency
bound) and records what a client sees. Two backends exist: an in-process
vLLM engine stepped by the driver's thread (``vllm_runner``) and live
OpenAI-compatible servers (``endpoint``).

Contract of a backend (all calls from the driver's thread):
    send(request)            start serving ``request`` now
    poll(timeout_s) -> list  events since the last poll, waiting at most
                             ``timeout_s`` when there are none: tuples
                             ("first", id, t) when the first token arrived and
                             ("done", id, t, {"tokens": [...], "cached_tokens": int})
                             when the request finished; ``t`` from ``time.perf_counter()``.
                             A backend reports "first" before (or with) "done".
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Protocol

from kvtier.bench.workloads import Phase, Request, hash_ids


class Backend(Protocol):
    def send(self, request: Request) -> None: ...
    def poll(self, timeout_s: float) -> list[tuple]: ...


def run_phase(phase: Phase, backend: Backend, *, t0: float | None = None, block_tokens: int = 256,
              on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Serve every request of ``phase`` through ``backend``; return one record
    per request, in completion order. Times in records are seconds from ``t0``
    (default: the phase start)."""
    start = time.perf_counter()
    t0 = start if t0 is None else t0
    by_id = {r.id: r for r in phase.requests}
    waiting_on: dict[str, list[Request]] = {}
    ready: list[tuple[float, int, str]] = []   # (ready time, list order, id)
    order = {r.id: i for i, r in enumerate(phase.requests)}
    for r in phase.requests:
        if r.after is not None and r.after in by_id:
            waiting_on.setdefault(r.after, []).append(r)
        else:
            heapq.heappush(ready, (start + r.at_s, order[r.id], r.id))
    in_flight: dict[str, dict] = {}
    records: list[dict] = []
    while ready or in_flight:
        now = time.perf_counter()
        while ready and ready[0][0] <= now and len(in_flight) < phase.concurrency:
            t_ready, _, rid = heapq.heappop(ready)
            t_send = time.perf_counter()
            backend.send(by_id[rid])
            in_flight[rid] = {"t_ready": t_ready, "t_send": t_send, "t_first": None}
        if not in_flight:
            time.sleep(max(0.0, min(ready[0][0] - now, 0.05)))
            continue
        # Wait for events, but no longer than until the next request may be sent.
        wait = 0.05
        if ready and len(in_flight) < phase.concurrency:
            wait = max(0.0, min(ready[0][0] - time.perf_counter(), wait))
        for ev in backend.poll(wait):
            kind, rid, t = ev[0], ev[1], ev[2]
            state = in_flight.get(rid)
            if state is None:
                continue
            if kind == "first":
                state["t_first"] = t if state["t_first"] is None else state["t_first"]
                continue
            out = ev[3]
            r = by_id[rid]
            t_first = state["t_first"] if state["t_first"] is not None else t
            rec = {
                "phase": phase.name, "id": rid, "session": r.session, "turn": r.turn, "instance": r.instance,
                "prompt_tokens": len(r.tokens), "output_tokens": len(out.get("tokens", ())),
                "cached_tokens": out.get("cached_tokens", 0),
                "t_ready": state["t_ready"] - t0, "t_send": state["t_send"] - t0,
                "t_first": t_first - t0, "t_done": t - t0,
                "ttft_s": t_first - state["t_send"], "queue_s": state["t_send"] - state["t_ready"],
                "hash_ids": hash_ids(r.tokens, block_tokens), "block_tokens": block_tokens,
                "output": list(out.get("tokens", ())),
            }
            records.append(rec)
            if on_done:
                on_done(rec)
            del in_flight[rid]
            for nxt in waiting_on.pop(rid, ()):
                heapq.heappush(ready, (t + nxt.think_s, order[nxt.id], nxt.id))
    return records
