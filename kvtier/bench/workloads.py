"""Benchmark workloads as data: phases of requests with dependencies.

A workload is a list of phases run one after the other (a phase starts when
every request of the previous one has finished). Within a phase a request
becomes *ready* at ``max(at_s, finish(after) + think_s)`` (``at_s`` counted
from the phase start; ``after`` is the id of the previous turn of the same
session, or ``None``) and is *sent* as soon as fewer than ``concurrency``
requests are in flight, ready requests in order of readiness, then of list
order. TTFT is measured from send to first token; queueing before the send is
reported apart (``queue_s``).

    W1  long-context cold resume: N sessions of L tokens are prefilled
        (phase "warm"), then queried again in the same order ("resume").
    W2  multi-turn chat: a shared system prompt, a history that grows every
        turn (user turn + answer), think time, Poisson session arrivals,
        bounded concurrency. The answers of the history are drawn from the
        workload, not taken from the model, so every configuration sees the
        same prompts (a trace replay).
    W1 swept over concurrency (``w1_sweep``): N sessions prefilled, then
        bursts of 1, 8, 16 ... of them returning at once, each burst cold,
        and last one session resumed with its KV still in the engine (the
        engine's own cost of a resume, which no storage can remove).
    W3  multi-instance: W1's phases with each request routed at random to one
        of K instances (the warm and the resume of a session usually land on
        different instances).

The same objects drive the in-process runner (``vllm_runner``), the endpoint
client and ``kvtier plan``; ``hash_ids`` gives the prefix-chained block ids
that request logs carry, so equal ids mean equal prefixes.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Request:
    id: str
    session: int
    turn: int
    tokens: tuple[int, ...]
    max_tokens: int
    after: str | None = None       # id of the request that must finish first (same phase)
    think_s: float = 0.0           # pause after ``after`` finishes
    at_s: float = 0.0              # earliest send, from the phase start
    instance: int = 0              # routing: which engine serves it


@dataclass(frozen=True)
class Phase:
    name: str
    requests: tuple[Request, ...]
    concurrency: int = 1
    # Measured phases feed the report; the others only prepare state.
    measured: bool = True
    # Drop kvtier's memory tier and the page cache of its file tiers before
    # the phase, so that its hits are cold reads from storage.
    cold: bool = False


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    phases: tuple[Phase, ...]
    instances: int = 1
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Workload":
        phases = tuple(
            Phase(p["name"], tuple(Request(**{**r, "tokens": tuple(r["tokens"])}) for r in p["requests"]),
                  p["concurrency"], p["measured"], p["cold"])
            for p in d["phases"]
        )
        return Workload(d["name"], d["description"], phases, d["instances"], d.get("params", {}))

    def for_instance(self, k: int) -> "Workload":
        """The part of the workload that instance ``k`` serves: its requests,
        and its share of each phase's concurrency (dependencies on requests
        served elsewhere are dropped: the router resolves them)."""
        phases = []
        for p in self.phases:
            reqs = tuple(r for r in p.requests if r.instance == k)
            ids = {r.id for r in reqs}
            reqs = tuple(r if r.after is None or r.after in ids else Request(**{**asdict(r), "after": None})
                         for r in reqs)
            share = max(1, -(-p.concurrency // self.instances))
            phases.append(Phase(p.name, reqs, share, p.measured, p.cold))
        return Workload(self.name, self.description, tuple(phases), 1, self.params)


def hash_ids(tokens, block_tokens: int) -> list[int]:
    """Prefix-chained 63-bit ids of the full ``block_tokens`` blocks of
    ``tokens``: block i's id depends on every token of blocks 0..i, so two
    prompts share their first n ids exactly when they share their first
    n blocks of tokens (the Mooncake trace convention)."""
    out, h = [], b""
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.blake2b(h + struct.pack(f"<{len(block)}I", *block), digest_size=8).digest()
        out.append(int.from_bytes(h, "little") >> 1)
    return out


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    # Ids 0-2 are often special (bos/eos/pad); prompts avoid them.
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def w1(sessions: int, context: int, vocab: int, seed: int = 0, resumes: int = 1) -> Workload:
    """``resumes`` > 1 resumes every session again, each round a cold phase
    of its own ("resume", "resume-2", ...): more samples per prefill where
    prefills are slow. With two or more sessions a round's resume of a
    session is never in vLLM's own cache (the other sessions evicted it)."""
    if resumes > 1 and sessions < 2:
        raise ValueError("resuming a session more than once needs at least 2 sessions (with one, the engine's "
                         "own prefix cache would still hold it)")
    rng = random.Random(seed * 1000 + context)
    prompts = [_tokens(rng, context, vocab) for _ in range(sessions)]
    warm = tuple(Request(f"s{i}-warm", i, 0, p, 1) for i, p in enumerate(prompts))
    rounds = []
    for k in range(1, max(1, resumes) + 1):
        tag = "resume" if k == 1 else f"resume-{k}"
        reqs = tuple(Request(f"s{i}-{tag}", i, k, p, 1) for i, p in enumerate(prompts))
        rounds.append(Phase(tag, reqs, cold=True))
    desc = f"long-context cold resume: {sessions} sessions of {context} tokens"
    params = {"sessions": sessions, "context": context, "seed": seed}
    if resumes > 1:
        desc += f", each resumed {resumes} times"
        params["resumes"] = resumes
    return Workload("W1", desc, (Phase("warm", warm, measured=False), *rounds), params=params)


def w1_sweep(levels: tuple[int, ...], context: int, vocab: int, seed: int = 0, answer_tokens: int = 16) -> Workload:
    """Many sessions returning at once: ``max(levels)`` sessions of
    ``context`` tokens are prefilled ("warm", not measured), then for each
    level c the first c of them are resumed together ("c<c>": all sent at
    once, a cold phase), each answering ``answer_tokens`` tokens; last,
    session 0 is resumed alone with its KV still in the engine ("engine":
    what the engine itself spends on a resume, the suffix's compute)."""
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be positive integers, got {levels}")
    rng = random.Random(seed * 1000 + context)
    n = max(levels)
    prompts = [_tokens(rng, context, vocab) for _ in range(n)]
    warm = tuple(Request(f"s{i}-warm", i, 0, p, 1) for i, p in enumerate(prompts))
    phases = [Phase("warm", warm, concurrency=1, measured=False)]
    for k, c in enumerate(levels, 1):
        reqs = tuple(Request(f"s{i}-c{c}", i, k, prompts[i], answer_tokens) for i in range(c))
        phases.append(Phase(f"c{c}", reqs, concurrency=c, cold=True))
    phases.append(Phase("engine", (Request("s0-engine", 0, len(levels) + 1, prompts[0], answer_tokens),)))
    return Workload("W1", f"concurrency sweep: {n} sessions of {context} tokens, bursts of "
                    f"{', '.join(map(str, levels))} returning at once, {answer_tokens} tokens answered",
                    tuple(phases), params={"sessions": n, "context": context, "seed": seed,
                                           "levels": list(levels), "answer_tokens": answer_tokens})


def w3(sessions: int, context: int, vocab: int, instances: int, seed: int = 0, resumes: int = 1) -> Workload:
    """W1 over ``instances`` engines, each request routed uniformly at random."""
    base = w1(sessions, context, vocab, seed, resumes)
    rng = random.Random(seed * 7919 + instances)
    phases = []
    for p in base.phases:
        reqs = tuple(Request(**{**asdict(r), "instance": rng.randrange(instances)}) for r in p.requests)
        phases.append(Phase(p.name, reqs, concurrency=instances, measured=p.measured, cold=p.cold))
    return Workload("W3", f"multi-instance cold resume: {sessions} sessions of {context} tokens over "
                    f"{instances} instances, random routing", tuple(phases), instances,
                    {**base.params, "instances": instances})


@dataclass(frozen=True)
class ChatShape:
    """Distributions of W2 (lengths in tokens, times in seconds)."""
    sessions: int = 8
    turns: tuple[int, int] = (2, 4)            # turns per session, uniform inclusive
    system_tokens: int = 512                   # shared by every session
    user_tokens: tuple[int, int] = (64, 384)   # uniform inclusive
    answer_tokens: tuple[int, int] = (16, 64)  # uniform inclusive; also max_tokens of the turn
    think_s: float = 8.0                       # mean of an exponential pause between turns
    arrival_rate: float = 0.5                  # Poisson session arrivals per second
    concurrency: int = 4


def w2(shape: ChatShape, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    system = _tokens(rng, shape.system_tokens, vocab)
    reqs, t = [], 0.0
    for s in range(shape.sessions):
        history = system
        prev = None
        for k in range(rng.randint(*shape.turns)):
            user = _tokens(rng, rng.randint(*shape.user_tokens), vocab)
            answer = _tokens(rng, rng.randint(*shape.answer_tokens), vocab)
            prompt = history + user
            rid = f"s{s}-t{k}"
            reqs.append(Request(rid, s, k, prompt, len(answer), after=prev,
                                think_s=rng.expovariate(1 / shape.think_s) if prev else 0.0,
                                at_s=t if prev is None else 0.0))
            history = prompt + answer
            prev = rid
        t += rng.expovariate(shape.arrival_rate)
    return Workload(
        "W2", f"multi-turn chat: {shape.sessions} sessions, shared {shape.system_tokens}-token system prompt, "
        f"Poisson arrivals {shape.arrival_rate}/s, concurrency {shape.concurrency}",
        (Phase("chat", tuple(reqs), concurrency=shape.concurrency),),
        params={**asdict(shape), "seed": seed},
    )


def w0(sessions: int, context: int, vocab: int, seed: int = 0, concurrency: int = 2) -> Workload:
    """Zero hits: distinct prompts only, so a connector can only cost (its
    lookups miss, its saves run). Measures kvtier's overhead."""
    rng = random.Random(seed * 1000 + context + 1)
    reqs = tuple(Request(f"s{i}", i, 0, _tokens(rng, context, vocab), 8) for i in range(sessions))
    return Workload("W0", f"zero-hit overhead: {sessions} distinct prompts of {context} tokens, "
                    f"concurrency {concurrency}", (Phase("fresh", reqs, concurrency=concurrency),),
                    params={"sessions": sessions, "context": context, "seed": seed})
