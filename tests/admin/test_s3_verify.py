"""``kvtier store verify --tier s3://...`` against the session's SeaweedFS:
what it reports of forged, tampered and replayed objects with and without
the cluster key, that --quarantine deletes them through the tier, that the
collector's lease is no object, and that the secret key never shows."""

from __future__ import annotations

import secrets

import pytest

from kvtier.cli import main
from kvtier.codec import encode
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers.s3 import lease as s3lease
from kvtier.tiers.s3.tier import S3Tier
from tests.support import DTYPE, keys_for, payload_for, plant_attacks, shape_for
from tests.tiers.redisserver import free_port
from tests.tiers.s3server import ACCESS_KEY, BUCKET, s3_config, shared_server
from tests.admin.test_redis_verify import assert_verify_reports_then_deletes

SECRET = "kvtier-verify-s3cret-access-key"


@pytest.fixture
def env(monkeypatch):
    # SeaweedFS without identities takes any keys: these are the ones the CLI uses.
    monkeypatch.setenv("KVTIER_S3_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("KVTIER_S3_SECRET_ACCESS_KEY", SECRET)


def _verify(capsys, *args: str) -> tuple[int, str]:
    rc = main(["store", "verify", "--no-progress", *args])
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    return rc, out + err


def _plant(client, tier: S3Tier, keys) -> list[str]:
    return plant_attacks(lambda name: client.get_object(Bucket=BUCKET, Key=name)["Body"].read(),
                         lambda name, data: client.put_object(Bucket=BUCKET, Key=name, Body=data),
                         [tier.object_name(k) for k in keys], keys)


def test_verify_reports_what_engines_refuse_and_quarantine_deletes_it(env, key_file, capsys, caplog):
    srv = shared_server()
    prefix = f"verify/{secrets.token_hex(4)}"
    cfg = s3_config(srv, prefix, 1 << 30, name="verify")
    keys = keys_for(13, 5)
    with TieredStore(StoreConfig(tiers=(TierSpec("s3", cfg),), auth_key_file=key_file), Metrics()) as store:
        store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
        assert store.flush(10)
    client = srv.client()
    tier = S3Tier(cfg)
    try:
        planted = _plant(client, tier, keys)
        # The collector's lease lives under the same folder: no chunk object, skipped.
        assert s3lease.take(client, BUCKET, f"{tier.base}/{s3lease.LEASE_NAME}", 60) is not None
        url = f"s3://{BUCKET}/{prefix}?endpoint={srv.endpoint}&region=us-east-1"
        assert_verify_reports_then_deletes(lambda *a: _verify(capsys, *a), url, key_file, planted)
        rc, out = _verify(capsys, "--tier", url, "--auth-key-file", key_file, "--quarantine")
        assert rc == 1 and "3 bad (deleted)" in out
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{tier.base}/")["Contents"]
        assert sorted(o["Key"] for o in listed) == sorted(
            [tier.object_name(keys[0]), tier.object_name(keys[4]), f"{tier.base}/{s3lease.LEASE_NAME}"])
        rc, out = _verify(capsys, "--tier", url, "--auth-key-file", key_file)
        assert rc == 0 and "verified 2 objects; 0 bad" in out
        assert SECRET not in caplog.text
    finally:
        tier.close()


def test_delete_names_counts_what_it_freed():
    srv = shared_server()
    tier = S3Tier(s3_config(srv, f"verify/{secrets.token_hex(4)}", 1 << 30, name="verify-delete"))
    try:
        keys = keys_for(14, 3)
        objs = [encode(k, DTYPE, shape_for(k.num_tokens), payload_for(k)) for k in keys]
        assert tier.store(objs) == 3
        before = tier.stats()
        names = [tier.object_name(k) for k in keys[:2]]
        assert tier.delete_names(names + ["not/there"]) == 2
        after = tier.stats()
        assert after.objects == before.objects - 2
        assert after.used_bytes == before.used_bytes - sum(len(o.buf) for o in objs[:2])
        assert tier.lookup(keys) == 0 and tier.lookup(keys[2:]) == 1
    finally:
        tier.close()


def test_a_dead_endpoint_or_missing_bucket_is_exit_status_2(env, capsys):
    srv = shared_server()
    rc, out = _verify(capsys, "--tier", f"s3://{BUCKET}/x?endpoint=http://127.0.0.1:{free_port()}&region=us-east-1"
                      "&max_attempts=1")
    assert rc == 2 and "cannot list" in out and "KVTIER_S3_SECRET_ACCESS_KEY" in out and "Traceback" not in out
    rc, out = _verify(capsys, "--tier", f"s3://no-such-bucket-{secrets.token_hex(4)}/x?endpoint={srv.endpoint}"
                      "&region=us-east-1")
    assert rc == 2 and "cannot list" in out and "NoSuchBucket" in out and "Traceback" not in out
    rc, out = _verify(capsys, "--tier", f"s3://{BUCKET}/x?endpoint={srv.endpoint}&secret_access_key={SECRET}")
    assert rc == 2 and "credential" in out
