"""Trace loaders on samples in the real formats, block-id normalisation and
token expansion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.workloads import ChatShape, w2
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, chunk_keys
from kvtier.plan import loaders
from kvtier.plan.synth import SynthShape, from_workload, synth, to_mooncake
from kvtier.plan.traces import expand_prompt, expand_tokens, to_units

DATA = Path(__file__).parent / "data"
SAMPLE_SHAPE = SynthShape(sessions=40, turns=(1, 6), system_prompts=3, system_tokens=1024, user_tokens=(32, 512),
                          answer_tokens=(16, 256), think_s=20.0, arrival_rate=0.5, seed=1)


def _lines(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines()]


def test_samples_are_reproduced_by_the_generator():
    recs = synth(SAMPLE_SHAPE)
    assert _lines(DATA / "bailian_sample.jsonl") == recs
    assert _lines(DATA / "mooncake_sample.jsonl") == to_mooncake(recs)


def test_bailian_sample_sessions_times_and_shared_prefixes():
    tr = loaders.load(DATA / "bailian_sample.jsonl", unit_tokens=128)
    assert tr.meta["format"] == "bailian" and tr.meta["block_tokens"] == 16
    reqs = list(tr)
    raw = _lines(DATA / "bailian_sample.jsonl")
    assert len(reqs) == tr.count == len(raw) == 127
    # Seconds stay seconds; sessions follow parent_chat_id back to the root chat.
    assert [r.t for r in reqs] == [x["timestamp"] for x in raw]
    by_chat = {x["chat_id"]: x for x in raw}
    for r, x in zip(reqs, raw):
        root = x
        while root["parent_chat_id"] >= 0:
            root = by_chat[root["parent_chat_id"]]
        assert r.session == root["chat_id"]
        assert len(r.units) == x["input_length"] // 128
    # A later turn extends its parent's prompt: every whole unit of the parent is shared.
    for r, x in zip(reqs, raw):
        if x["parent_chat_id"] >= 0:
            parent = reqs[raw.index(by_chat[x["parent_chat_id"]])]
            n = parent.prompt_tokens // 128
            assert r.units[:n] == parent.units[:n]
    # Sessions with the same system prompt (1024 tokens = 8 units) share exactly those units.
    firsts = [r for r, x in zip(reqs, raw) if x["turn"] == 1 and len(r.units) > 8]
    groups = {}
    for r in firsts:
        groups.setdefault(r.units[0], []).append(r)
    assert 1 < len(groups) <= 3
    a, b = next(g for g in groups.values() if len(g) > 1)[:2]
    assert a.units[:8] == b.units[:8] and a.units[8] != b.units[8]


def test_mooncake_sample_is_the_same_traffic_at_512_token_blocks():
    mc = list(loaders.load(DATA / "mooncake_sample.jsonl", unit_tokens=128))
    bl = list(loaders.load(DATA / "bailian_sample.jsonl", unit_tokens=128))
    raw = _lines(DATA / "mooncake_sample.jsonl")
    assert [r.t for r in mc] == [x["timestamp"] / 1000 for x in raw]  # ms -> s
    assert [r.prompt_tokens for r in mc] == [r.prompt_tokens for r in bl]
    # Sharing is the same wherever it is visible at 512-token granularity:
    # two requests share a whole 512-token block in one trace iff in the other.
    for i in range(0, len(mc), 7):
        for j in range(i + 1, len(mc), 11):
            m = sum(1 for _ in _common(mc[i].units, mc[j].units))
            b = sum(1 for _ in _common(bl[i].units, bl[j].units))
            assert m // 4 == b // 4


def _common(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def test_units_split_and_group_blocks():
    # 512-token blocks into 128-token units; the partial last block only gives whole units.
    u = to_units([5, 6, 7], 512, 2 * 512 + 300, 128)
    assert len(u) == (2 * 512 + 300) // 128 == 10
    assert len(set(u)) == 10
    v = to_units([5, 6, 9], 512, 3 * 512, 128)
    assert v[:8] == u[:8] and v[8] != u[8]
    # 16-token blocks grouped into 128-token units: only whole groups.
    w = to_units(list(range(20)), 16, 20 * 16, 128)
    assert len(w) == 2
    assert to_units(list(range(16)) + [99], 16, 17 * 16, 128) == w
    # Ids that are not prefix-chained (a per-block hash) gain the chain: same
    # block id after different prefixes gives different units.
    assert to_units([1, 2], 128, 256, 128)[1] != to_units([3, 2], 128, 256, 128)[1]
    with pytest.raises(ValueError):
        to_units([1], 96, 96, 128)


def test_expanded_tokens_give_equal_kvtier_chunk_keys_exactly_for_equal_ids():
    assert expand_tokens(42, 512) == expand_tokens(42, 512)
    assert expand_tokens(42, 512) != expand_tokens(43, 512)
    assert all(3 <= t < 32000 for t in expand_tokens(7, 1000))
    a = expand_prompt([1, 2, 3, 4], 512, 2000)
    b = expand_prompt([1, 2, 9, 4], 512, 2000)
    assert len(a) == 2000 and a[:1024] == b[:1024] and a[1024:1536] != b[1024:1536]
    ns = Namespace("m", "fp", "bfloat16", "t", 2, 2, 8, chunk_tokens=256)
    ka, kb = chunk_keys(ns, a), chunk_keys(ns, b)
    shared = sum(1 for _ in _common(ka, kb))
    assert shared == 4  # 1024 common tokens = 4 chunks, and the unit ids agree
    ua, ub = to_units([1, 2, 3, 4], 512, 2000, 128), to_units([1, 2, 9, 4], 512, 2000, 128)
    assert sum(1 for _ in _common(ua, ub)) == 8


def test_kvtier_request_log(tmp_path):
    wl = w2(ChatShape(sessions=3, turns=(2, 3)), vocab=512, seed=3)
    recs = list(from_workload(wl, block_tokens=128, config="kvtier-memory"))
    recs += [dict(r, config="recompute") for r in recs]
    p = tmp_path / "requests.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tr = loaders.load(p, unit_tokens=128)
    assert tr.meta["format"] == "kvtier" and tr.meta["config"] == "kvtier-memory"
    assert tr.meta["configs"] == ["kvtier-memory", "recompute"]
    reqs = list(tr)
    assert len(reqs) == len(recs) // 2
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    # Turns of a session extend each other: the whole blocks of turn k are in turn k+1.
    by = {(r.session, r.turn): r for r in reqs}
    for (s, t), r in by.items():
        nxt = by.get((s, t + 1))
        if nxt:
            assert nxt.units[: len(r.units)] == r.units
    with pytest.raises(ConfigError):
        loaders.load(p, config="nope")


def test_unknown_format_is_a_config_error(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"foo": 1}\n')
    with pytest.raises(ConfigError):
        loaders.load(p)


def test_synthetic_sessions_follow_their_shape():
    from kvtier.plan.synth import SynthShape

    shape = SynthShape.from_chat(ChatShape(sessions=30, turns=(2, 4), system_tokens=256), seed=3)
    recs = synth(shape)
    roots = [r for r in recs if r["parent_chat_id"] < 0]
    assert len(roots) == 30
    assert all(2 <= max(x["turn"] for x in recs if _root(recs, x) == r["chat_id"]) <= 4 for r in roots)
    # Every session starts with the one shared system prompt (256 tokens = 16 blocks).
    assert len({tuple(r["hash_ids"][:16]) for r in roots}) == 1
    assert all(r["input_length"] >= 256 + 64 for r in recs)
    assert [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)


def _root(recs, x):
    by = {r["chat_id"]: r for r in recs}
    while x["parent_chat_id"] >= 0:
        x = by[x["parent_chat_id"]]
    return x["chat_id"]
