"""``kvtier store verify --tier redis://...`` against real redis-servers:
what it reports of forged, tampered and replayed objects with and without
the cluster key, that --quarantine deletes them through the tier (its
accounting stays right), and that a password never shows."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import redis

from kvtier import auth
from kvtier.cli import main
from kvtier.codec import encode
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers.redis.config import RedisConfig
from kvtier.tiers.redis.tier import RedisTier
from tests.support import DTYPE, keys_for, payload_for, plant_attacks, shape_for
from tests.tiers.redisserver import RedisServer, free_port
from tests.tiers.tlscerts import make_pki

SECRET = "s3cret-pa55word-of-the-test"


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", SECRET)
    s = RedisServer(tmp_path / "redis", password=SECRET)
    yield s
    s.stop()


def _config(address: str, **kw) -> RedisConfig:
    return RedisConfig(address=address, capacity=1 << 24, io_threads=2, password=SECRET, **kw)


def _save(cfg: RedisConfig, key_file: str, keys) -> None:
    with TieredStore(StoreConfig(tiers=(TierSpec("redis", cfg),), auth_key_file=key_file), Metrics()) as store:
        store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
        assert store.flush(10)


def _plant(raw: redis.Redis, tier: RedisTier, keys) -> list[str]:
    names = [tier.object_name(k) for k in keys]
    return [n.decode() for n in plant_attacks(raw.get, raw.set, names, keys)]


def assert_verify_reports_then_deletes(verify, url: str, key_file: str, planted: list[str]) -> None:
    """``kvtier store verify --tier URL`` on a tier of five objects of which
    ``plant_attacks`` changed three: what it reports without the key (the
    replay only: the others' checksums are right) and with it (all three, by
    reason), then --quarantine deletes the three. The same for every tier
    kind that --tier takes."""
    tampered, forged, replayed = planted
    rc, out = verify("--tier", url)
    assert rc == 1 and "seals not checked" in out
    assert "verified 4 objects; 1 bad (left in place; --quarantine deletes them)" in out
    assert f"{replayed}: header key or namespace does not match the object's name" in out
    rc, out = verify("--tier", url, "--auth-key-file", key_file)
    assert rc == 1 and "verified 2 objects; 3 bad" in out
    assert f"{tampered}: not served: {auth.BAD_SEAL}" in out
    assert f"{forged}: not served: {auth.UNSEALED}" in out
    assert f"{replayed}: header key" in out


def _verify(capsys, *args: str) -> tuple[int, str]:
    rc = main(["store", "verify", "--no-progress", *args])
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    return rc, out + err


def test_verify_reports_what_engines_refuse_and_quarantine_deletes_it(server, key_file, capsys, caplog):
    cfg = _config(server.address)
    keys = keys_for(9, 5)
    _save(cfg, key_file, keys)
    raw = redis.Redis(host="127.0.0.1", port=server.port, password=SECRET)
    tier = RedisTier(cfg)
    try:
        url = f"redis://{server.address}"
        assert_verify_reports_then_deletes(lambda *a: _verify(capsys, *a), url, key_file, _plant(raw, tier, keys))
        before = tier.stats()
        assert before.objects == 5
        rc, out = _verify(capsys, "--tier", url, "--auth-key-file", key_file, "--quarantine")
        assert rc == 1 and "3 bad (deleted)" in out
        names = [tier.object_name(k) for k in keys]
        assert [raw.exists(n) for n in names] == [1, 0, 0, 0, 1]
        # Deleted through the tier: unindexed, and their bytes no longer counted.
        after = tier.stats()
        assert after.objects == 2 and after.used_bytes == before.used_bytes * 2 // 5
        assert sorted(raw.zrange("{kvtier:v1:idx}:lru", 0, -1)) == sorted([names[0], names[4]])
        rc, out = _verify(capsys, "--tier", url, "--auth-key-file", key_file)
        assert rc == 0 and "verified 2 objects; 0 bad" in out
        assert SECRET not in caplog.text
    finally:
        tier.close()


def test_a_name_whose_value_is_gone_is_skipped_and_key_prefix_is_honoured(server, key_file, capsys):
    cfg = _config(server.address, key_prefix="other:")
    keys = keys_for(10, 3)
    _save(cfg, key_file, keys)
    raw = redis.Redis(host="127.0.0.1", port=server.port, password=SECRET)
    tier = RedisTier(cfg)
    try:
        raw.delete(tier.object_name(keys[0]))  # evicted by Redis meanwhile: its name stays indexed
        rc, out = _verify(capsys, "--tier", f"redis://{server.address}?key_prefix=other:", "--auth-key-file", key_file)
        assert rc == 0 and "verified 2 objects; 0 bad" in out
        rc, out = _verify(capsys, "--tier", f"redis://{server.address}", "--auth-key-file", key_file)
        assert rc == 0 and "verified 0 objects; 0 bad" in out  # the default prefix holds nothing
    finally:
        tier.close()


def test_an_unreachable_or_refusing_server_is_exit_status_2(server, capsys, monkeypatch):
    rc, out = _verify(capsys, "--tier", f"redis://127.0.0.1:{free_port()}")
    assert rc == 2 and "cannot reach the Redis server" in out and "Traceback" not in out
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "not-" + SECRET)
    rc, out = _verify(capsys, "--tier", f"redis://{server.address}")
    assert rc == 2 and "KVTIER_REDIS_PASSWORD" in out and "not-" + SECRET not in out
    rc, out = _verify(capsys, "--tier", f"redis://{server.address}?password={SECRET}")
    assert rc == 2 and "credential" in out
    rc, out = _verify(capsys, "--tier", "shared:///mnt/kv")
    assert rc == 2 and "redis://" in out and "s3://" in out and "--dir" in out


def test_verify_walks_a_cluster_over_its_slots(tmp_path, key_file, capsys):
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            nodes.append(RedisServer(tmp_path / f"node{i}", cluster=True))
        subprocess.run(["redis-cli", "--cluster", "create", *(n.address for n in nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], capture_output=True, timeout=30, check=True)
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            assert time.monotonic() < deadline, "cluster did not come up"
            time.sleep(0.1)
        cfg = RedisConfig(address=nodes[0].address, capacity=1 << 24, io_threads=2, cluster=True)
        keys = keys_for(11, 8)
        _save(cfg, key_file, keys)
        raw = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        tier = RedisTier(cfg)
        try:
            evil = os.urandom(len(payload_for(keys[5])))
            raw.set(tier.object_name(keys[5]), bytes(encode(keys[5], DTYPE, shape_for(keys[5].num_tokens), evil).buf))
            url = f"redis://{nodes[1].address}?cluster=true"
            rc, out = _verify(capsys, "--tier", url, "--auth-key-file", key_file, "--quarantine")
            assert rc == 1 and "verified 7 objects; 1 bad (deleted)" in out
            assert not raw.exists(tier.object_name(keys[5])) and tier.stats().objects == 7
        finally:
            tier.close()
            raw.close()
    finally:
        for n in nodes:
            n.stop()


def test_verify_reaches_a_tls_server_by_rediss(tmp_path, key_file, capsys):
    pki = make_pki(tmp_path / "pki")
    server = RedisServer(tmp_path / "redis", tls=pki)
    try:
        tls = f"tls_ca_file={pki.ca}&tls_cert_file={pki.client_cert}&tls_key_file={pki.client_key}"
        cfg = RedisConfig(address=server.address, capacity=1 << 24, io_threads=2, tls=True, tls_ca_file=str(pki.ca),
                          tls_cert_file=str(pki.client_cert), tls_key_file=str(pki.client_key))
        _save(cfg, key_file, keys_for(12, 3))
        rc, out = _verify(capsys, "--tier", f"rediss://{server.address}?{tls}", "--auth-key-file", key_file)
        assert rc == 0 and "verified 3 objects; 0 bad" in out
    finally:
        server.stop()
