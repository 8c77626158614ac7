"""Contract-suite harness of the S3 tier against a real SeaweedFS S3 gateway.

One ``weed server`` is started lazily on first use and shared by every
harness instance of this test process (``s3server.shared_server()``); each
harness instance gets its own prefix in one bucket, so tests never see each
other's objects. The server lives in ``s3server`` (not here: this module is
imported by ``harness`` while ``harness`` itself is being imported).
"""

from __future__ import annotations

import secrets
import time

from kvtier.tiers.s3.tier import S3Tier
from tests.tiers.harness import Harness
from tests.tiers.s3server import s3_config, shared_server


class S3Harness(Harness):
    kind = "s3"

    def __init__(self, tmp_path, metrics):
        super().__init__(tmp_path, metrics)
        self.server = shared_server()
        self.prefix = f"contract/{self.name}-{secrets.token_hex(4)}"

    def _open(self, capacity):
        return S3Tier(s3_config(self.server, self.prefix, capacity, name=self.name), self.metrics)

    def settle(self, tier):
        # Capacity is enforced by watermark collection passes: run one.
        assert tier.gc().ran

    def tick(self):
        # Recency is this process's own access stamp (wall clock, fine
        # grained) where it has one: a short sleep orders two accesses.
        time.sleep(0.002)


HARNESS = S3Harness
