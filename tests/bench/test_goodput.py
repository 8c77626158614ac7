"""Goodput at a TTFT SLO over arrival rates (kvtier.bench.goodput): its
workload, its figures and verdicts from synthetic engine runs, the flags'
validation, and one tiny run of real engines."""

import argparse
import json
import math
import subprocess
import sys

import pytest

from kvtier import argtypes
from kvtier.bench import goodput, workloads
from kvtier.bench.resume import ResumeConfig

SHAPE = workloads.ChatShape(sessions=4, turns=(2, 3), system_tokens=256, user_tokens=(64, 128),
                            answer_tokens=(4, 8), think_s=1.0, concurrency=2)


def test_each_rate_is_the_same_conversations_in_tokens_of_its_own():
    w = goodput.workload(SHAPE, (0.5, 2.0), vocab=1000, seed=3)
    assert [p.name for p in w.phases] == ["rate-0.5", "rate-2"]
    slow, fast = (p.requests for p in w.phases)
    # The same structure: turns, lengths, dependencies, think times.
    assert [(r.id, r.session, r.turn, len(r.tokens), r.max_tokens, r.after, r.think_s) for r in slow] == \
        [(r.id, r.session, r.turn, len(r.tokens), r.max_tokens, r.after, r.think_s) for r in fast]
    # Arrivals: the same draws, gaps scaled by 1/rate.
    for a, b in zip(slow, fast):
        assert a.at_s == pytest.approx(4 * b.at_s)
    assert max(r.at_s for r in slow) > 0
    # Within a rate, sessions share the system prompt and a turn extends its
    # history; across rates no block of tokens is shared.
    for reqs in (slow, fast):
        first = [r for r in reqs if r.turn == 0]
        assert len({r.tokens[:256] for r in first}) == 1
        by_id = {r.id: r for r in reqs}
        for r in reqs:
            if r.after:
                assert r.tokens[:len(by_id[r.after].tokens)] == by_id[r.after].tokens
    ids = [set(workloads.hash_ids(r.tokens, 128)) for r in slow], [set(workloads.hash_ids(r.tokens, 128)) for r in fast]
    assert not set().union(*ids[0]) & set().union(*ids[1])
    assert all(3 <= t < 1000 for p in w.phases for r in p.requests for t in r.tokens)
    assert w.params["rates"] == [0.5, 2.0]


@pytest.mark.parametrize("p95s, expect", [
    ([0.5, 1.0, 3.0, 4.0], (0.5, 1.0)),       # falls off at the third rate
    ([0.5, 1.0, 1.5, 2.0], (2.0, None)),      # holds at every rate (2.0 == SLO holds)
    ([2.5, 1.0, 1.5, 2.0], (None, 0.25)),     # misses even the lowest
    ([0.5, 3.0, 1.0, 1.0], (0.25, 0.5)),      # a later recovery does not count
    ([0.5, math.nan, 1.0, 1.0], (0.25, 0.5)),  # a rate without figures misses
])
def test_goodput_is_the_last_rate_before_the_knee(p95s, expect):
    assert goodput.goodput_and_knee([0.25, 0.5, 1.0, 2.0], p95s, 2.0) == expect


def _records(rate: float, ttfts: list[float], queue: float = 0.0, span: float = 10.0) -> list[dict]:
    """A phase's driver records: two turns per session, the last done at ``span``."""
    out = []
    for i, x in enumerate(ttfts):
        ready = 0.4 * i
        out.append({"phase": goodput.phase_name(rate), "session": i // 2, "turn": i % 2, "t_ready": ready,
                    "t_send": ready + queue, "t_first": ready + queue + x, "t_done": min(span, ready + queue + x + 0.1),
                    "ttft_s": x, "queue_s": queue})
    out[-1]["t_done"] = span
    return out


def _run(config: str, rnd: int, p95_by_rate: dict[float, float], queue: float = 0.0) -> dict:
    records = []
    for rate, top in p95_by_rate.items():
        # 20 requests, the two slowest at ``top``: p95 is ``top``.
        records += _records(rate, [top / 10] * 18 + [top, top], queue=queue)
    return {"config": config, "round": rnd, "case": "chat", "records": records}


def _cfg(tmp_path, rates=(0.25, 0.5, 1.0, 2.0), slo=2.0, rounds=2):
    return ResumeConfig(workdir=tmp_path, workload="w2", model="tiny-llama", rates=rates, slo_s=slo, rounds=rounds,
                        chat=SHAPE)


def test_summarise_judges_each_rate_and_the_bar(tmp_path):
    rates = (0.25, 0.5, 1.0, 2.0)
    runs = []
    for rnd in (0, 1):
        runs.append(_run("prefix-cache", rnd, {0.25: 1.0, 0.5: 3.0 + rnd, 1.0: 5.0, 2.0: 9.0}))
        runs.append(_run("kvtier-shared", rnd, {0.25: 0.4, 0.5: 0.5, 1.0: 1.5 + rnd, 2.0: 4.0}))
        # Queued 2 s behind the concurrency bound: its engine TTFTs hold the
        # SLO, the user's do not.
        runs.append(_run("recompute", rnd, {0.25: 0.5, 0.5: 0.5, 1.0: 0.5, 2.0: 0.5}, queue=2.0))
    s = goodput.summarise(_cfg(tmp_path, rates), runs, {})
    pc, kv, rc = (s["results"][n] for n in ("prefix-cache", "kvtier-shared", "recompute"))
    assert (pc["goodput_rate"], pc["knee_rate"]) == (0.25, 0.5)
    assert (kv["goodput_rate"], kv["knee_rate"]) == (1.0, 2.0)
    assert (rc["goodput_rate"], rc["knee_rate"]) == (None, 0.25)
    # Figures per rate are medians over the rounds' own figures.
    one = kv["rates"]["rate-1"]
    assert one["ttft_p95_s"] == pytest.approx(2.0) and one["meets_slo"]
    assert [r["ttft_p95_s"] for r in one["rounds"]] == pytest.approx([1.5, 2.5])
    assert rc["rates"]["rate-0.25"]["ttft_p95_s"] == pytest.approx(2.5)
    assert rc["rates"]["rate-0.25"]["engine_ttft_p95_s"] == pytest.approx(0.5)
    # 10 sessions of 2 turns over the 10 s from the first ready turn to the last answer.
    assert one["sessions_per_s"] == pytest.approx(1.0) and one["requests_per_s"] == pytest.approx(2.0)
    assert kv["goodput_sessions_per_s"] == pytest.approx(1.0)
    c = s["check"]
    assert c["met"] is True and c["ratio"] == pytest.approx(4.0)
    table = goodput.format_table(s)
    assert "kvtier-shared 1/s vs prefix-cache 0.25/s (knee 0.5/s) = 4.00x met" in table
    assert "goodput     none  knee   0.25/s" in table
    paths = goodput.write_report(s, tmp_path / "report")
    assert json.loads((tmp_path / "report" / "goodput.json").read_text())["check"]["met"] is True
    assert all(p.stat().st_size > 0 for p in paths)


def _by(**rates) -> dict:
    return {name.replace("_", "-"): {"goodput_rate": g, "knee_rate": k} for name, (g, k) in rates.items()}


@pytest.mark.parametrize("by, met, ratio", [
    (_by(kvtier_shared=(0.5, 1.0), prefix_cache=(0.25, 0.5)), True, 2.0),
    (_by(kvtier_shared=(0.5, 1.0), prefix_cache=(0.5, 1.0)), False, 1.0),
    (_by(kvtier_shared=(None, 0.25), prefix_cache=(0.25, 0.5)), False, 0.0),
    # prefix cache never fell off: its goodput is only a lower bound.
    (_by(kvtier_shared=(2.0, None), prefix_cache=(2.0, None)), None, None),
    # prefix cache missed at every rate: judged only if kvtier held 2x the lowest.
    (_by(kvtier_shared=(0.5, 1.0), prefix_cache=(None, 0.25)), True, None),
    (_by(kvtier_shared=(0.25, 0.5), prefix_cache=(None, 0.25)), None, None),
    (_by(prefix_cache=(0.25, 0.5)), None, None),
])
def test_the_bar_is_judged_only_where_the_grid_finds_prefix_caches_knee(by, met, ratio):
    c = goodput.check(by, [0.25, 0.5, 1.0, 2.0])
    assert c["met"] is met and c["ratio"] == ratio
    if met is None:
        assert c["why"]


def test_rates_and_slo_read_as_the_help_says():
    assert argtypes.positive_floats("1,0.25,0.5,1") == (0.25, 0.5, 1.0)
    assert [argtypes.seconds(t) for t in ("2", "2s", "500ms", "1.5S")] == [2.0, 2.0, 0.5, 1.5]
    for bad in ("", "inf", "nan", "-2s", "2m", "ms"):
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.seconds(bad)
    for bad in ("", ",", "nan", "1,inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            argtypes.positive_floats(bad)


@pytest.mark.parametrize("args, key", [
    (["--workload", "w2", "--rates", "0.5,x"], "--rates"),
    (["--workload", "w2", "--rates", "0,1"], "--rates"),
    (["--workload", "w2", "--rates", "-1"], "--rates"),
    (["--workload", "w1", "--rates", "1,2"], "--rates"),
    (["--workload", "w2", "--rates", "1", "--endpoint", "http://localhost:1"], "--rates"),
    (["--workload", "w2", "--rates", "1", "--slo", "soon"], "--slo"),
    (["--workload", "w2", "--rates", "1", "--slo", "0s"], "--slo"),
    (["--workload", "w2", "--slo", "2s"], "--slo"),
])
def test_bad_rates_and_slo_exit_2_naming_the_flag(tmp_path, args, key):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "resume", "--dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_goodput_smoke_on_real_engines(tmp_path):
    """Two rates, each a phase of one engine run per configuration: every
    rate's requests are served and judged, and kvtier serves second turns."""
    out = tmp_path / "goodput.json"
    proc = subprocess.run(
        # load_decision always: with the tiny model a hit loads about as fast as
        # it computes, and the hits asserted here must not depend on timing.
        [sys.executable, "-m", "kvtier.cli", "bench", "resume", "--workload", "w2", "--dir", str(tmp_path / "run"),
         "--model", "tiny-llama", "--no-progress", "--load-decision", "always", "--json", str(out),
         "--sessions", "3", "--turns", "2,2", "--system-tokens", "256", "--user-tokens", "64,128",
         "--answer-tokens", "4,8", "--think", "0.2", "--concurrency", "2", "--rates", "2,8", "--slo", "30s"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["kind"] == "goodput" and s["rates"] == [2.0, 8.0] and s["slo_s"] == 30.0
    assert set(s["results"]) == set(goodput.CONFIGS)
    for name, v in s["results"].items():
        for phase in ("rate-2", "rate-8"):
            f = v["rates"][phase]
            assert f["requests"] == 6 and f["sessions_per_s"] > 0, (name, phase)
            assert 0 < f["ttft_p50_s"] <= f["ttft_p95_s"] <= f["ttft_p99_s"], (name, phase)
        # A generous SLO on a tiny model: held at both rates, no knee.
        assert (v["goodput_rate"], v["knee_rate"]) == (8.0, None), name
    assert s["check"]["met"] is None and "add higher --rates" in s["check"]["why"]
    assert "acceptance bar:" in proc.stdout and "not judged" in proc.stdout
    report = tmp_path / "run" / "report"
    for f in ("goodput.json", "goodput.md", "goodput.png", "requests.jsonl"):
        assert (report / f).stat().st_size > 0, f
    reqs = [json.loads(line) for line in (report / "requests.jsonl").open()]
    # Second turns resume their history: from kvtier, or the engine's own
    # cache; never from the other rate's phase (its tokens are its own).
    second = [r for r in reqs if r["config"] == "kvtier-shared" and r["turn"] == 1]
    assert len(second) == 6 and all(r["cached_tokens"] >= 256 for r in second)
    first_fast = [r for r in reqs if r["config"] == "kvtier-shared" and r["phase"] == "rate-8" and r["turn"] == 0]
    # The first session of the second rate finds nothing: not its system prompt, not the other rate's turns.
    assert min(r["cached_tokens"] for r in first_fast) == 0
    assert all(r["cached_tokens"] == 0 for r in reqs if r["config"] == "recompute")
