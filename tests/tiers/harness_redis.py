"""The redis tier in the contract suite, against a real ``redis-server``
(``redisserver.RedisServer``: one server on a free loopback port, stopped by
its own PID).
"""

from __future__ import annotations

from kvtier.tiers.redis.config import RedisConfig

from kvtier.tiers.redis.tier import RedisTier
from tests.tiers.harness import Harness
from tests.tiers.redisserver import RedisServer


class RedisHarness(Harness):
    kind = "redis"

    def __init__(self, tmp_path, metrics):
        super().__init__(tmp_path, metrics)
        self.server = RedisServer(self.path)

    def _open(self, capacity):
        return RedisTier(RedisConfig(address=self.server.address, capacity=capacity, name=self.name, io_threads=4), self.metrics)

    def close_all(self):
        try:
            super().close_all()
        finally:
            self.server.stop()


HARNESS = RedisHarness
