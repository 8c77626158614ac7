"""Synthetic multi-turn traces, and kvtier's bench workloads as traces.

``synth`` draws sessions the way ``kvtier.bench.workloads.w2`` does (its
``ChatShape``: a shared system prompt, a history that grows by a user turn and
an answer every turn, exponential think time, Poisson session arrivals) and
adds what planning needs at scale: several system prompts shared by many
sessions, and length distributions with long tails. It writes no tokens, only
block ids, in the Bailian format (``chat_id``/``parent_chat_id`` sessions) or
the Mooncake format; both load back with ``kvtier.plan.loaders``.

A session is one token stream (system prompt, then user turn, answer, user
turn, ...); turn k's prompt is a prefix of it. A full block's id names its
position in its stream (blocks wholly inside a system prompt are shared by
every session with that prompt); a prompt's partial last block gets an id of
its own.

``from_workload`` turns a bench ``Workload`` (W1, W2, W3) into the records
``kvtier bench resume`` logs, without an engine: for tests and for planning a
workload before running it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.bench.workloads import ChatShape, Workload, hash_ids


@dataclass(frozen=True)
class SynthShape:
    sessions: int = 200
    turns: tuple[int, int] = (1, 8)              # per session, uniform inclusive
    system_prompts: int = 4                      # distinct shared prefixes, picked with Zipf(1) weights
    system_tokens: int = 2048
    user_tokens: tuple[int, int] = (64, 1024)    # log-uniform inclusive
    answer_tokens: tuple[int, int] = (32, 512)   # log-uniform inclusive
    think_s: float = 30.0                        # mean pause between turns
    arrival_rate: float = 1.0                    # sessions per second (Poisson)
    seed: int = 0

    @staticmethod
    def from_chat(shape: ChatShape, **kw) -> SynthShape:
        """The shape of bench workload W2 (one system prompt)."""
        return SynthShape(sessions=shape.sessions, turns=shape.turns, system_prompts=1,
                          system_tokens=shape.system_tokens, user_tokens=shape.user_tokens,
                          answer_tokens=shape.answer_tokens, think_s=shape.think_s,
                          arrival_rate=shape.arrival_rate, **kw)


def _loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(lo * (hi / lo) ** rng.random()) if hi > lo else lo


def synth(shape: SynthShape, block_tokens: int = 16) -> list[dict]:
    """Bailian-format records (16-token blocks by default), ordered by time."""
    rng = random.Random(shape.seed)
    ids: dict[tuple, int] = {}

    def bid(key: tuple) -> int:
        v = ids.get(key)
        if v is None:
            v = ids[key] = len(ids)
        return v

    weights = [1.0 / (i + 1) for i in range(shape.system_prompts)]
    out: list[dict] = []
    t = 0.0
    chat = 0
    for s in range(shape.sessions):
        t += rng.expovariate(shape.arrival_rate)
        sp = rng.choices(range(shape.system_prompts), weights)[0]
        length = shape.system_tokens
        at, parent = t, -1
        for turn in range(1, rng.randint(*shape.turns) + 1):
            prompt = length + _loguniform(rng, *shape.user_tokens)
            answer = _loguniform(rng, *shape.answer_tokens)
            full = prompt // block_tokens
            blocks = [bid(("sys", sp, i)) if (i + 1) * block_tokens <= shape.system_tokens else bid(("s", s, i))
                      for i in range(full)]
            if prompt % block_tokens:
                blocks.append(bid(("tail", chat)))
            out.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": round(at, 3),
                        "input_length": prompt, "output_length": answer, "type": "text", "turn": turn,
                        "hash_ids": blocks})
            parent = chat
            chat += 1
            length = prompt + answer
            at += rng.expovariate(1 / shape.think_s) if shape.think_s > 0 else 0.0
    out.sort(key=lambda r: (r["timestamp"], r["chat_id"]))
    return out


def to_mooncake(records: list[dict], block_tokens: int = 512, source_block_tokens: int = 16) -> list[dict]:
    """The same requests in the Mooncake format: ``timestamp`` in ms, one id
    per ``block_tokens`` block (a group of source blocks, renumbered in order
    of first appearance, so equal ids mean equal prefixes)."""
    r_ = block_tokens // source_block_tokens
    ids: dict[tuple, int] = {}
    out = []
    for rec in records:
        hs, key = [], 0
        for i in range(0, len(rec["hash_ids"]), r_):
            key = hash((key, tuple(rec["hash_ids"][i:i + r_])))
            hs.append(ids.setdefault(key, len(ids)))
        out.append({"timestamp": round(rec["timestamp"] * 1000), "input_length": rec["input_length"],
                    "output_length": rec["output_length"], "hash_ids": hs})
    return out


def write_jsonl(records, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        f.writelines(json.dumps(r, separators=(", ", ": ")) + "\n" for r in records)
    return p


def from_workload(w: Workload, block_tokens: int = 128, config: str = "plan") -> Iterator[dict]:
    """Driver-format records of a bench workload, as if served instantly:
    ``t_send`` is each request's earliest send (``at_s``, or its predecessor's
    send plus think time). Measured fields are absent."""
    for p in w.phases:
        sent: dict[str, float] = {}
        for r in p.requests:
            t = r.at_s if r.after is None else sent.get(r.after, 0.0) + r.think_s
            sent[r.id] = t
            yield {"phase": p.name, "id": r.id, "session": r.session, "turn": r.turn, "instance": r.instance,
                   "prompt_tokens": len(r.tokens), "output_tokens": r.max_tokens, "t_send": t,
                   "hash_ids": hash_ids(r.tokens, block_tokens), "block_tokens": block_tokens,
                   "workload": w.name, "config": config}


def shape_json(shape: SynthShape) -> dict:
    return asdict(shape)
