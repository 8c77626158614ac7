"""Fixtures of the tier tests: stops the shared SeaweedFS server of the S3
harness at the end of the session (it is started lazily by the first test
that needs it; atexit is only the fallback)."""

from __future__ import annotations


def pytest_sessionfinish(session, exitstatus):
    from tests.tiers import s3server

    s3server.shutdown()
