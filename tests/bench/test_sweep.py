"""The concurrency sweep's parts: its workload, its floor, its figures from
engine runs, and the modelled local drive's throttle on a real device."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier import argtypes
from kvtier.bench import blkio, sweep, workloads
from kvtier.bench.resume import ResumeConfig


def test_sweep_workload_resumes_each_level_together_and_cold():
    w = workloads.w1_sweep((1, 4, 8), 512, 1000, answer_tokens=5)
    names = [p.name for p in w.phases]
    assert names == ["warm", "c1", "c4", "c8", "engine"]
    warm = w.phases[0]
    assert not warm.measured and len(warm.requests) == 8
    for p, c in zip(w.phases[1:4], (1, 4, 8)):
        assert p.cold and p.concurrency == c and len(p.requests) == c
        # The sessions warmed, asked again, answering 5 tokens each, all ready at once.
        assert [r.tokens for r in p.requests] == [r.tokens for r in warm.requests[:c]]
        assert all(r.max_tokens == 5 and r.after is None and r.at_s == 0 for r in p.requests)
    engine = w.phases[-1]
    assert not engine.cold and engine.requests[0].tokens == warm.requests[0].tokens
    with pytest.raises(ValueError):
        workloads.w1_sweep((0, 2), 512, 1000)


def test_floor_is_a_two_stage_pipeline():
    # The device bound: loads of 1 s one after another, 0.25 s of engine each.
    assert sweep.floor(1.0, 0.25, 3) == [1.25, 2.25, 3.25]
    # The engine bound: each suffix waits for the one before.
    assert sweep.floor(0.1, 1.0, 3) == pytest.approx([1.1, 2.1, 3.1])


def _run(config: str, rnd: int, ttfts: dict, hits: dict, vllm_hits: dict, nbytes: int, busy: float) -> dict:
    """An engine run as resume._run_config returns it, with the counters a
    run's phases leave behind (cumulative)."""
    records, pm = [], {"warm": {"kvtier": {}, "vllm": {}}}
    kv = {"kvtier_read_bytes_total{tier=shared}": 0.0, "kvtier_vllm_load_busy_seconds_total": 0.0,
          "kvtier_vllm_external_hit_tokens_total{tier=shared}": 0.0}
    vl = {"vllm:external_prefix_cache_hits": 0.0}
    for phase, xs in ttfts.items():
        for i, x in enumerate(xs):
            records.append({"phase": phase, "ttft_s": x, "t_send": 0.0, "t_done": max(xs) + 0.5,
                            "output_tokens": 4, "cached_tokens": 384 if phase == "engine" else 0})
        if phase != "engine":
            kv = {"kvtier_read_bytes_total{tier=shared}": kv["kvtier_read_bytes_total{tier=shared}"] + nbytes * len(xs),
                  "kvtier_vllm_load_busy_seconds_total": kv["kvtier_vllm_load_busy_seconds_total"] + busy,
                  "kvtier_vllm_external_hit_tokens_total{tier=shared}":
                      kv["kvtier_vllm_external_hit_tokens_total{tier=shared}"] + hits[phase]}
            vl = {"vllm:external_prefix_cache_hits": vl["vllm:external_prefix_cache_hits"] + vllm_hits[phase]}
        pm[phase] = {"kvtier": dict(kv), "vllm": dict(vl)}
    return {"config": config, "case": "2048", "round": rnd, "records": records, "phase_metrics": pm}


def test_summarise_sets_each_level_against_its_floor(tmp_path):
    cfg = ResumeConfig(workdir=tmp_path, contexts=(2048,), concurrency=(1, 2), rounds=1)
    runs = [
        _run("kvtier-shared", 0, {"c1": [0.30], "c2": [0.30, 0.60], "engine": [0.20]},
             {"c1": 2000, "c2": 4000}, {"c1": 2000, "c2": 4000}, nbytes=100_000_000, busy=0.1),
        _run("kvtier-local-drive", 0, {"c1": [0.40], "c2": [0.40, 0.70], "engine": [0.20]},
             {"c1": 2000, "c2": 4000}, {"c1": 2000, "c2": 3900}, nbytes=100_000_000, busy=0.2),
    ]
    device = {"depth": 8, "gbps_by_streams": {"1": 1.0, "2": 2.0}, "best_gbps": 2.0, "local_drive_bps": 1e9}
    s = sweep.summarise(cfg, runs, device, {})
    shared = s["results"]["2048"]["kvtier-shared"]
    assert shared["engine_s"] == 0.2
    c2 = shared["levels"]["2"]
    # 100 MB at 2 GB/s: 0.05 s per load, the engine's 0.2 s each after it.
    assert c2["floor"]["load_s"] == pytest.approx(0.05)
    assert c2["floor"]["p50_s"] == pytest.approx((0.25 + 0.45) / 2)
    assert c2["over_floor"] == pytest.approx(0.45 / 0.35)
    # 200 MB read in the burst over 0.1 s of loading: 2 GB/s, 1.0 x fio at 2 streams.
    assert c2["read_gbps"] == pytest.approx(2.0) and c2["read_vs_fio"] == pytest.approx(1.0)
    assert c2["hit_tokens"] == 4000 and c2["vllm_external_prefix_cache_hits"] == 4000
    local = s["results"]["2048"]["kvtier-local-drive"]["levels"]["2"]
    assert local["floor"]["rate_gbps"] == pytest.approx(2.0 * cfg.local_ratio)
    checks = s["checks"]
    assert checks["2048: kvtier-shared hit tokens equal vLLM's external hits at every level"]["met"]
    # A level whose hits differ from vLLM's is named.
    assert checks["2048: kvtier-local-drive hit tokens equal vLLM's external hits at every level"] == {
        "value": "2", "bar": None, "met": False}
    assert checks["2048: kvtier-shared TTFT p50 over the floor at 2"]["met"] is (0.45 / 0.35 <= 1.2)
    table = sweep.format_table(s)
    assert "MODELLED" in table and "floor (shared)" in table


def test_local_ratio_reads_a_or_a_over_b():
    assert argtypes.ratio("6.78:10.3") == pytest.approx(0.6583, abs=1e-4)
    assert argtypes.ratio("0.5") == 0.5
    for bad in ("x", "1:0", "-1", "0"):
        with pytest.raises(Exception):
            argtypes.ratio(bad)


@pytest.mark.parametrize("args, key", [
    (["--workload", "w0", "--concurrency", "2"], "--concurrency"),
    (["--workload", "w2", "--concurrency", "2,4"], "--concurrency"),
    (["--concurrency", "0,4"], "--concurrency"),
    (["--concurrency", "1,4", "--resumes", "2"], "--resumes"),
])
def test_sweep_flags_refuse_what_a_sweep_cannot_run(tmp_path, args, key):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "resume", "--dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and key in proc.stderr, proc.stderr


def _direct_read_gbps(path: Path, throttle: blkio.ReadThrottle | None) -> float:
    """Read ``path`` with O_DIRECT in a child process (inside ``throttle``)."""
    code = ("import mmap, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT); buf = mmap.mmap(-1, 1 << 20); n = 0\n"
            "t = time.perf_counter()\n"
            "while True:\n"
            "    k = os.readv(fd, [buf])\n"
            "    n += k\n"
            "    if k < len(buf): break\n"
            "print(n / (time.perf_counter() - t) / 1e9)\n")
    join = (lambda: throttle.join(os.getpid())) if throttle else None
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                         preexec_fn=join, timeout=120)
    return float(out.stdout)


def test_read_throttle_holds_a_process_to_its_rate(tmp_path):
    """The modelled local drive: the same device, read through the kernel's
    block throttle. Needs root and a block device (the CI machine has both)."""
    assert blkio.why_not(tmp_path) == "", blkio.why_not(tmp_path)
    f = tmp_path / "data"
    with open(f, "wb") as out:
        out.write(os.urandom(1 << 20) * 48)
        out.flush()
        os.fsync(out.fileno())
    with blkio.ReadThrottle(tmp_path, 40e6, name=f"kvtier-test-{os.getpid()}") as throttle:
        t0 = time.perf_counter()
        slow = _direct_read_gbps(f, throttle)
        assert time.perf_counter() - t0 > 0.8  # 48 MiB at 40 MB/s: ~1.2 s
    assert slow < 0.05, slow
    assert not throttle.dir.exists()
    fast = _direct_read_gbps(f, None)
    assert fast > 3 * slow, (fast, slow)
