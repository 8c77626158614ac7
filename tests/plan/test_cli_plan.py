"""``kvtier plan`` end to end on the shipped sample."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"


def test_help_explains_inputs_and_outputs(kvtier):
    out = kvtier("plan", "--help").stdout
    for word in ("Mooncake", "Bailian", "requests.jsonl", "--validate", "report.md", "summary.json",
                 "--storage-json", "--calibrate", "--engine-kv", "--routing"):
        assert word in out


def test_plan_on_the_sample_writes_the_report(tmp_path, kvtier):
    proc = kvtier("plan", str(DATA / "bailian_sample.jsonl"), "--model", "qwen2.5-0.5b", "--engine-tokens", "8192",
                  "--memory", "256MiB", "--disk", "2GiB", "--shared", "16GiB", "--instances", "2",
                  "--routing", "random", "--out", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "hit ratio" in proc.stdout and "with kvtier" in proc.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["trace"]["requests"] == 127 and s["trace"]["format"] == "bailian"
    hr = s["hit_ratio"]
    assert abs(hr["total"] - hr["engine"] - hr["memory"] - hr["disk"] - hr["shared"]) < 1e-9
    assert 0 < hr["kvtier"] < 1 and hr["shared"] > 0  # random routing: the shared tier serves other instances' sessions
    assert set(s["curves"]) == {"engine", "memory", "disk", "shared"}
    for c in s["curves"].values():
        assert c["hit_ratio"] == sorted(c["hit_ratio"])  # more capacity never holds less
    assert s["ttft_s"]["kvtier"]["p50"] <= s["ttft_s"]["baseline"]["p50"] <= s["ttft_s"]["recompute"]["p50"]
    md = (tmp_path / "report.md").read_text()
    assert "What to buy" in md and "| shared |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped" in md
    else:
        assert (tmp_path / "plan-hit_ratio.png").stat().st_size > 1000
        assert (tmp_path / "plan-ttft_cdf.png").stat().st_size > 1000


def test_mooncake_format_and_bad_usage(kvtier):
    proc = kvtier("plan", str(DATA / "mooncake_sample.jsonl"), "--memory", "1GiB", "--json", "--no-progress",
                  "--curve-sample", "0")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s["trace"]["format"] == "mooncake" and "curves" in s and not s["curves"]
    bad = kvtier("plan", str(DATA / "mooncake_sample.jsonl"), "--memory", "1GiB", "--model", "nope")
    assert bad.returncode == 2 and "--model" in bad.stderr
    none = kvtier("plan")
    assert none.returncode == 2 and "trace" in none.stderr


def test_each_tier_is_simulated_under_the_eviction_policy_its_flag_names(kvtier):
    args = (str(DATA / "mooncake_sample.jsonl"), "--memory", "1GiB", "--shared", "2GiB", "--json", "--no-progress",
            "--curve-sample", "0")
    s = json.loads(kvtier("plan", *args, "--shared-eviction", "lru").stdout)
    assert [(t["kind"], t["eviction"]) for t in s["config"]["tiers"]] == [("memory", "lru"), ("shared", "lru")]
    lfu = json.loads(kvtier("plan", *args[:-2], "--memory-eviction", "lfu").stdout)
    assert lfu["config"]["tiers"][0]["eviction"] == "lfu"
    curve = lfu["curves"]["memory"]  # replayed under lfu: no stack distances for it
    assert len(curve["hit_ratio"]) == len(curve["capacity_bytes"]) > 1 and 0 < curve["best"] <= 1
    bad = kvtier("plan", *args, "--memory-eviction", "watermark")
    assert bad.returncode == 2 and "--memory-eviction" in bad.stderr and "low_watermark" in bad.stderr
    bad = kvtier("plan", *args, "--shared-eviction", "mru")
    assert bad.returncode == 2 and "--shared-eviction" in bad.stderr and "lru, watermark" in bad.stderr
