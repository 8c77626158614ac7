"""Smoke run of `kvtier bench resume` (W1) with the tiny model: every
configuration runs in a real vLLM engine and the report has what the issue
names. Speed is a benchmark matter, not asserted here."""

import json
import subprocess
import sys


def test_bench_resume_w1_smoke(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "resume", "--dir", str(tmp_path / "w"), "--model", "tiny-llama",
         "--contexts", "512", "--sessions", "3", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not run on this host" in proc.stdout and "lmcache" in proc.stdout
    s = json.loads(out.read_text())
    by = s["results"]["512"]
    assert set(by) == {"recompute", "prefix-cache", "kvtier-memory", "kvtier-disk", "kvtier-shared", "example"}
    for name, v in by.items():
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps", "hit_tokens"):
            assert key in v, (name, key)
        assert 0 < v["ttft_p50_s"] <= v["ttft_p90_s"] <= v["ttft_p99_s"]
        assert len(v["ttft_s"]) == 3
    # The engine evicted every session: only connectors serve the resumes.
    assert by["recompute"]["cached_tokens_p50"] == 0
    assert by["prefix-cache"]["cached_tokens_p50"] == 0
    for name, tier in (("kvtier-memory", "memory"), ("kvtier-disk", "disk"), ("kvtier-shared", "shared")):
        assert by[name]["cached_tokens_p50"] == 384, name  # whole blocks of 512, one token left to compute
        assert by[name]["hit_tokens"] == {tier: 3 * 384}, name
        assert by[name]["vllm_external_prefix_cache_hits"] == 3 * 384, name
    assert by["example"]["cached_tokens_p50"] > 0
    report = tmp_path / "w" / "report"
    for f in ("results.json", "report.md", "ttft_cdf.png", "speedup.png", "hits.png"):
        assert (report / f).stat().st_size > 0, f
