"""The redis tier over TLS in the contract suite: a ``redis-server`` that
speaks only TLS and requires client certificates (``tls-auth-clients yes``,
its default), reached as a ``rediss://`` URL with the CA, a client
certificate and its key; the server's certificate names 127.0.0.1, checked."""

from __future__ import annotations

from kvtier.config import parse_tier
from kvtier.tiers.redis.tier import RedisTier
from tests.tiers.harness import Harness
from tests.tiers.redisserver import RedisServer
from tests.tiers.tlscerts import make_pki


class RedisTlsHarness(Harness):
    kind = "redis-tls"
    tier_kind = "redis"

    def __init__(self, tmp_path, metrics):
        super().__init__(tmp_path, metrics)
        self.pki = make_pki(self.path / "pki")
        self.server = RedisServer(self.path / "server", tls=self.pki)

    def _open(self, capacity):
        p = self.pki
        spec = parse_tier(f"rediss://{self.server.address}?capacity={capacity}B&name={self.name}&io_threads=4"
                          f"&tls_ca_file={p.ca}&tls_cert_file={p.client_cert}&tls_key_file={p.client_key}", "tiers[0]")
        return RedisTier(spec.config, self.metrics)

    def close_all(self):
        try:
            super().close_all()
        finally:
            self.server.stop()


HARNESS = RedisTlsHarness
