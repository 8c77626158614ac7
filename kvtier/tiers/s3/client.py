"""The S3 tier's boto3 client: made per process (a forked child makes its
own), its timeouts, retries and addressing; the bucket made at start where
asked. A part of ``S3Tier`` (``tier``), which owns the state."""

from __future__ import annotations

import logging
import os
from typing import Any

from kvtier.tiers.s3 import lease as s3lease, presigned

log = logging.getLogger(__name__)


class S3Client:
    """The client of ``S3Tier``."""

    def _client(self):
        with self._lock:
            if self._client_obj is None or self._client_pid != os.getpid():
                self._client_obj = self._make_client()
                self._client_pid = os.getpid()
            return self._client_obj

    def client(self):
        """The boto3 client (thread-safe; made anew in a forked child): for
        tools that measure the same store, e.g. ``kvtier bench storage``."""
        return self._client()

    def tls_context(self):
        """The TLS settings of this tier's plain HTTP reads (``presigned``), for
        tools that measure the same store."""
        return presigned.tls_context(self.config)

    def _make_client(self):
        import boto3
        from botocore.config import Config

        c = self.config
        style = c.addressing_style
        if style == "auto":
            style = "path" if c.endpoint else "auto"
        bc = Config(
            connect_timeout=c.connect_timeout_s,
            read_timeout=c.read_timeout_s,
            retries={"max_attempts": c.max_attempts, "mode": "standard"},
            # The pool's workers, plus callers that run ``store`` or ``gc``
            # on their own threads: no request waits for a connection.
            max_pool_connections=c.io_threads + 8,
            s3={"addressing_style": style},
            parameter_validation=False,  # our requests are fixed in code; saves CPU per call
            # Plain PUT bodies: many S3-compatible servers reject the
            # aws-chunked trailing checksums newer botocore sends by default.
            # Our codec checksums every object end to end anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        verify: bool | str = (c.ca_bundle or True) if c.verify_tls else False
        # A session per client: boto3's default session is not thread-safe.
        return boto3.session.Session().client(
            "s3",
            endpoint_url=c.endpoint or None,
            region_name=c.region or None,
            aws_access_key_id=c.access_key_id,
            aws_secret_access_key=c.secret_access_key,
            verify=verify,
            config=bc,
        )

    def _create_bucket(self) -> None:
        client = self._client()
        try:
            client.head_bucket(Bucket=self.bucket)
            return
        except self._errors.ClientError as exc:
            if s3lease.http_status(exc) not in (404, 400):
                log.warning("tier %s: cannot check bucket %s: %s", self.name, self.bucket, brief(exc))
                return
        except self._errors.BotoCoreError as exc:
            log.warning("tier %s: cannot reach %s: %s", self.name, self.config.endpoint or "S3", exc)
            return
        try:
            kw: dict[str, Any] = {"Bucket": self.bucket}
            if self.config.region and self.config.region != "us-east-1":
                kw["CreateBucketConfiguration"] = {"LocationConstraint": self.config.region}
            client.create_bucket(**kw)
            log.info("tier %s: created bucket %s", self.name, self.bucket)
        except self._errors.ClientError as exc:
            if s3lease.error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                log.warning("tier %s: cannot create bucket %s: %s", self.name, self.bucket, brief(exc))
        except self._errors.BotoCoreError as exc:
            log.warning("tier %s: cannot create bucket %s: %s", self.name, self.bucket, exc)


def brief(exc: BaseException) -> str:
    """An error for logs: botocore's messages name the operation and the
    endpoint, never credentials."""
    return f"{type(exc).__name__}: {exc}"


def log_failure(name: str, what: str):
    def cb(fut) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("tier %s: background %s failed: %s", name, what, brief(fut.exception()))

    return cb
