"""Redis and S3 tiers, reached as the engine reaches them.

Each check builds the tier from its config (the tier's own client: the same
address, credentials, TLS settings and timeouts as the engine's) and makes
one read-only call: ``PING`` on Redis, a one-key listing of the tier's
prefix on S3. Nothing is written, so write permission is not proven; a
bucket is never created (``create_bucket`` is ignored here). An S3 call is
tried once (``max_attempts`` is for the engine's calls).
"""

from __future__ import annotations

import dataclasses
import time

from kvtier.check.report import Report


def redis_tier(report: Report, label: str, config) -> None:
    from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError

    from kvtier.tiers.redis.tier import RedisTier

    name = f"{label} reach"
    where = f"{config.address}{' (cluster)' if config.cluster else ''} with TLS {'on' if config.tls else 'off'}, " \
            f"as {config.username or 'the default user'}"
    tier = RedisTier(config)
    try:
        t0 = time.perf_counter()
        # The tier's own client (made on first use; no call reaches the
        # server before ping).
        tier._redis().ping()
        report.ok(name, f"PING answered in {(time.perf_counter() - t0) * 1e3:.1f} ms by {where}")
    except (AuthenticationError, ResponseError) as exc:
        unset = "" if config.password else " (no password is configured)"
        report.fail(name, f"{where}: the server refused{unset}: {exc}", "check username and password (the config file, "
                    "or KVTIER_REDIS_PASSWORD / KVTIER_REDIS_PASSWORD_<TIER NAME> in the engine's environment) "
                    "and the user's ACL")
    except (RedisError, RedisClusterException, OSError) as exc:  # RedisClusterException: no node maps the slots
        report.fail(name, f"cannot reach {where}: {exc}", "check the address, that the server runs and that this "
                    "node may reach it (firewall, bind, protected-mode); for TLS: tls: true and tls_ca_file")
    finally:
        tier.close()


def s3_tier(report: Report, label: str, config) -> None:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    from kvtier.tiers.s3.tier import S3Tier

    name = f"{label} reach"
    config = dataclasses.replace(config, create_bucket=False, max_attempts=1)
    where = f"bucket {config.bucket} at {config.endpoint or 'AWS S3'}"
    tier = S3Tier(config)
    try:
        t0 = time.perf_counter()
        tier.client().list_objects_v2(Bucket=config.bucket, Prefix=tier.base + "/", MaxKeys=1)
        report.ok(name, f"listed {where} in {(time.perf_counter() - t0) * 1e3:.0f} ms "
                  "(reads only: write access is not tried)")
    except NoCredentialsError:
        report.fail(name, f"{where}: no credentials found", "set access_key_id and secret_access_key (config or "
                    "KVTIER_S3_ACCESS_KEY_ID / KVTIER_S3_SECRET_ACCESS_KEY), or give boto3 its own (AWS_* "
                    "variables, a profile, an instance or pod role)")
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket", "404"):
            report.fail(name, f"{where}: the bucket does not exist", "create the bucket (or set create_bucket: "
                        "true, and the engine creates it at start)")
        elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken",
                      "ExpiredToken"):
            report.fail(name, f"{where}: the credentials were refused ({code})", "check access_key_id and "
                        "secret_access_key (or boto3's chain), and that the bucket policy lets them list the prefix")
        else:
            report.fail(name, f"{where}: {exc}", "check endpoint, region and the bucket")
    except BotoCoreError as exc:
        report.fail(name, f"cannot reach {where}: {exc}", "check endpoint (scheme, host, port), that the server "
                    "runs and that this node may reach it; for TLS: verify_tls and ca_bundle")
    finally:
        tier.close()
