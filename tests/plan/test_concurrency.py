"""The burst model of ``kvtier plan --sweep`` and its validation on sweep runs."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.plan import concurrency, sweepcheck
from kvtier.plan.concurrency import Burst, detect_steps, first_tokens, parse_rates, predict, rate_at
from kvtier.plan.sweepplan import session_shape
from tests.plan import fakesweep


def test_batched_steps_compute_every_finished_load_at_once():
    # Loads of 10 ms after 50 ms latency; S = 0.5 s of which 20 ms per step.
    b = Burst(4, 1e8, 10.0, 0.05, 0.5, 0.02, "batched")
    ts = first_tokens(b)
    assert ts[0] == pytest.approx(0.06 + 0.5)           # the first load ended alone: its own step
    assert ts[1:] == pytest.approx([0.56 + 0.02 + 3 * 0.48] * 3)  # the other three in one step
    assert predict(b)["ttft_p50_s"] == pytest.approx(2.02) and predict(b)["bound"] == "engine"


def test_staggered_steps_take_one_load_each():
    ts = first_tokens(Burst(4, 1e8, 10.0, 0.05, 0.5, 0.02, "staggered"))
    assert ts == pytest.approx([0.06 + k * 0.5 for k in range(1, 5)])   # L_1 + k*S
    assert predict(Burst(4, 1e8, 10.0, 0.05, 0.5, 0.02, "staggered"))["ttft_p50_s"] == pytest.approx(1.31)


def test_a_tier_slower_than_the_engine_sets_the_pace_in_both_policies():
    # 1 s per load, 0.5 s per suffix: each suffix is computed as soon as its load ends.
    for steps in concurrency.ENGINE_STEPS:
        b = Burst(3, 2e9, 2.0, 0.0, 0.5, 0.0, steps)
        assert first_tokens(b) == pytest.approx([1.5, 2.5, 3.5])
        assert predict(b)["bound"] == "tier"


def test_the_step_policy_is_read_from_the_bursts():
    assert detect_steps([[0.6, 2.0, 2.0, 2.0], [1.1, 1.1] + [3.7] * 6], 0.5) == "batched"
    assert detect_steps([[0.5, 1.0, 1.5, 2.0]], 0.5) == "staggered"
    assert detect_steps([[0.5], [0.5, 1.0]], 0.5) is None   # two sessions cannot tell


def test_read_rates_and_session_bytes():
    assert parse_rates("2GB/s") == {0: 2.0} and parse_rates("800MB/s") == {0: pytest.approx(0.8)}
    assert parse_rates("1GiB") == {0: pytest.approx(1.073741824)}
    rates = parse_rates("1:8.2,8:6.6")
    assert (rate_at(rates, 1), rate_at(rates, 4), rate_at(rates, 16)) == (8.2, 8.2, 6.6)
    for bad in ("fast", "0", "x:2", "4:"):
        with pytest.raises(ConfigError) as e:
            parse_rates(bad)
        assert e.value.key == "--read-rate"
    # 2048 tokens over blocks of 128: 1920 hit; the load reads the 8 chunks of 256 that hold them.
    assert session_shape(2048, 128, 256, 12288) == (1920, 2048 * 12288)


@pytest.mark.parametrize("steps", ["batched", "staggered"])
def test_a_sweep_that_follows_its_engine_validates(tmp_path, kvtier, steps):
    d = fakesweep.make_sweep(tmp_path / "run", steps)
    rows, law, _ = sweepcheck.run(sweepcheck.find(d))
    assert [(r.config, r.sessions) for r in rows] == [("kvtier-shared", c) for c in (1, 4, 8)]
    assert all(r.ok and r.engine_steps == steps and r.steps_from == "run" for r in rows)
    assert law.c == pytest.approx(fakesweep.OVERHEAD)
    assert rows[0].read_gbps == 8.0 and rows[2].read_gbps == 6.5
    proc = kvtier("plan", "--validate", str(d))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "validation passed" in proc.stdout and f"{steps} (run)" in proc.stdout


def test_the_wrong_step_policy_misses(tmp_path, kvtier):
    d = fakesweep.make_sweep(tmp_path / "run", "staggered")
    proc = kvtier("plan", "--validate", str(d), "--engine-steps", "batched")
    assert proc.returncode == 1 and "MISSED" in proc.stdout and "validation FAILED" in proc.stdout


def test_bursts_slower_than_the_engine_phase_miss(tmp_path, kvtier):
    d = fakesweep.make_sweep(tmp_path / "run", burst_scale=1.4)
    proc = kvtier("plan", "--validate", str(d), "--json")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    assert not doc["ok"] and [r["ok"] for r in doc["rows"]] == [False, False, False]
    assert all(r["ratio"] < 0.8 for r in doc["rows"])


def test_sweep_prediction_on_the_command_line(kvtier):
    proc = kvtier("plan", "--sweep", "--model", "qwen2.5-0.5b", "--context", "2048", "--concurrency", "1,4",
                  "--read-rate", "1:8,4:6.5", "--engine-s", "0.5", "--load-latency-ms", "0",
                  "--prefill", "1e-3,0,0.02", "--json")
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    load1, load4 = 2048 * 12288 / 8e9, 2048 * 12288 / 6.5e9
    assert p["cached_tokens"] == 1920 and p["engine_steps"] == "batched"
    assert p["levels"][0]["ttft_p50_s"] == pytest.approx(load1 + 0.5)
    assert p["levels"][1]["ttft_p50_s"] == pytest.approx(load4 + 0.5 + 0.02 + 3 * 0.48)
    # A step's fixed cost paid once for the three suffixes that share the second step.
    gpu = json.loads(kvtier("plan", "--sweep", "--model", "qwen2.5-0.5b", "--context", "2048", "--concurrency", "4",
                            "--read-rate", "6.5", "--engine-s", "0.5", "--load-latency-ms", "0",
                            "--step-overhead-ms", "400", "--json").stdout)
    assert gpu["levels"][0]["ttft_p50_s"] == pytest.approx(load4 + 0.5 + 0.4 + 3 * 0.1)
    table = kvtier("plan", "--sweep", "--model", "qwen2.5-0.5b", "--context", "2048", "--read-rate", "2GB/s",
                   "--engine-steps", "staggered")
    assert table.returncode == 0 and "steps staggered" in table.stdout and "prefill law" in table.stdout


@pytest.mark.parametrize("args, flag", [
    (["--sweep", "--read-rate", "fast"], "--read-rate"),
    (["--sweep", "--concurrency", "0,4"], "--concurrency"),
    (["--sweep", "--context", "100"], "--context"),
    (["--sweep", "--engine-s", "-1"], "--engine-s"),
    (["--sweep", "--load-latency-ms", "-5"], "--load-latency-ms"),
    (["--sweep", "--step-overhead-ms", "-1"], "--step-overhead-ms"),
    (["--sweep", "--engine-steps", "wobbly"], "--engine-steps"),
    (["--sweep", "--prefill", "1,2"], "--prefill"),
    (["--sweep", "trace.jsonl"], "--sweep"),
    (["trace.jsonl", "--read-rate", "2GB/s"], "--read-rate"),
    (["--synth", "--engine-steps", "staggered"], "--engine-steps"),
])
def test_bad_sweep_flags_exit_2_naming_the_flag(kvtier, args, flag):
    proc = kvtier("plan", *args)
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr


def test_a_sweep_run_without_fio_needs_a_read_rate(tmp_path, kvtier):
    d = fakesweep.make_sweep(tmp_path / "run", fio=False)
    proc = kvtier("plan", "--validate", str(d))
    assert proc.returncode == 2 and "--read-rate" in proc.stderr
    ok = kvtier("plan", "--validate", str(d), "--read-rate", "1:8,4:6.5")
    assert ok.returncode == 0, ok.stdout


def test_help_explains_the_sweep(kvtier):
    out = kvtier("plan", "--help").stdout
    for word in ("--sweep", "--concurrency", "--read-rate", "--engine-s", "--engine-steps", "staggered", "batched",
                 "sweep.json"):
        assert word in out


def test_an_unreadable_sweep_run_exits_2(tmp_path, kvtier):
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "sweep.json").write_text("{")
    proc = kvtier("plan", "--validate", str(tmp_path))
    assert proc.returncode == 2 and "--validate" in proc.stderr and "Traceback" not in proc.stderr


def test_the_law_from_another_sweep_run(tmp_path, kvtier):
    d, other = fakesweep.make_sweep(tmp_path / "run"), fakesweep.make_sweep(tmp_path / "other", seed=1)
    proc = kvtier("plan", "--validate", str(d), "--calibrate", str(other))
    assert proc.returncode == 0 and f"fitted to {other}" in proc.stdout, proc.stdout + proc.stderr
    # --sweep with the law of a sweep run: S is the law's resume of 128 tokens over 1920.
    p = json.loads(kvtier("plan", "--sweep", "--model", "qwen2.5-0.5b", "--context", "2048", "--calibrate", str(other),
                          "--read-rate", "6.5", "--json").stdout)
    assert p["engine_s"] == pytest.approx(fakesweep.ENGINE_S, rel=0.05) and "fitted to" in p["engine_s_from"]
