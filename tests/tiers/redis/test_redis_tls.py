"""The redis tier over TLS, against real TLS-only ``redis-server``s that
require client certificates (the contract suite runs over TLS too:
``harness_redis_tls``): what a wrong CA, a missing client certificate or a
host name the certificate does not name look like (misses, with OpenSSL's
reason in the log, never an exception), a cluster over TLS, a password over
TLS that never shows, and the TLS settings refused at start-up."""

from __future__ import annotations

import logging
import re
import subprocess
import time

import pytest

from kvtier.cli import main
from kvtier.config import load_config, parse_tier
from kvtier.concurrency.breaker import CircuitBreaker
from kvtier.errors import ConfigError
from kvtier.tiers.redis.tier import RedisTier
from tests.support import make_chunks
from tests.tiers.redisserver import RedisServer
from tests.tiers.redis.test_redis import fetched
from tests.tiers.tlscerts import encrypted_copy, make_pki


@pytest.fixture
def pki(tmp_path):
    return make_pki(tmp_path / "pki")


@pytest.fixture
def server(tmp_path, pki):
    s = RedisServer(tmp_path / "redis", tls=pki)
    yield s
    s.stop()


def tls_url(address: str, pki, **opts) -> str:
    """A rediss:// URL with the CA, client certificate and key of ``pki``
    (``opts`` add to or replace them; an empty value drops one)."""
    values = {"capacity": "16MiB", "io_threads": 2, "pool_size": 6, "socket_timeout_s": 2.0, "connect_timeout_s": 2.0,
              "tls_ca_file": pki.ca, "tls_cert_file": pki.client_cert, "tls_key_file": pki.client_key, **opts}
    return f"rediss://{address}?" + "&".join(f"{k}={v}" for k, v in values.items() if v != "")


def open_url(url: str, metrics) -> RedisTier:
    return RedisTier(parse_tier(url, "tiers[0]").config, metrics, CircuitBreaker(threshold=100))


def test_a_client_certificate_opens_a_server_that_requires_one(server, pki, metrics):
    tier = open_url(tls_url(server.address, pki), metrics)
    try:
        c = make_chunks(3)
        assert tier.store(c.objs) == 3
        assert tier.lookup(c.keys) == 3
        assert fetched(tier, c.keys) == 3  # the read path's own TLS sockets
        assert tier.stats().objects == 3
    finally:
        tier.close()
    assert server.cli("dbsize").strip() != "0"  # really on that server


@pytest.mark.parametrize("change, reason", [
    ({"tls_ca_file": "OTHER"}, "certificate verify failed"),  # a CA that did not sign the server's certificate
    # The server requires a client certificate. In TLS 1.3 the client's
    # handshake ends before the server's verdict arrives, so the first read
    # sees either the server's alert or the connection closing.
    ({"tls_cert_file": "", "tls_key_file": ""}, "certificate required|EOF occurred in violation of protocol"),
])
def test_a_refused_handshake_is_a_miss_with_the_reason(server, pki, metrics, caplog, change, reason):
    change = {k: (pki.other_ca if v == "OTHER" else v) for k, v in change.items()}
    url = tls_url(server.address, pki, **change)
    tier = open_url(url, metrics)  # start-up: nothing connects yet
    caplog.set_level(logging.WARNING)
    try:
        c = make_chunks(2)
        assert tier.store(c.objs) == 0
        assert tier.lookup(c.keys) == 0
        assert fetched(tier, c.keys) == 0
        assert metrics.value("kvtier_errors_total", tier="redis", op="lookup") >= 1
    finally:
        tier.close()
    assert "lookup failed" in caplog.text and re.search(reason, caplog.text)
    assert server.cli("dbsize").strip() == "0"


def test_the_certificate_must_name_the_host_unless_told_otherwise(server, pki, metrics, caplog):
    """The server's certificate names 127.0.0.1 only: reaching it as
    localhost fails the host name check, unless tls_check_hostname is off
    (the certificate is still verified against the CA)."""
    address = f"localhost:{server.port}"
    strict = open_url(tls_url(address, pki), metrics)
    caplog.set_level(logging.WARNING)
    c = make_chunks(2)
    try:
        assert strict.store(c.objs) == 0
    finally:
        strict.close()
    assert "Hostname mismatch" in caplog.text
    lax = open_url(tls_url(address, pki, tls_check_hostname="false"), metrics)
    try:
        assert lax.store(c.objs) == 2
        assert fetched(lax, c.keys) == 2
    finally:
        lax.close()
    other = open_url(tls_url(address, pki, tls_check_hostname="false", tls_ca_file=pki.other_ca), metrics)
    try:
        assert other.lookup(c.keys) == 0  # still no other CA
    finally:
        other.close()


def test_a_password_over_tls_comes_from_the_environment_and_never_shows(tmp_path, pki, metrics, caplog):
    secret = "pw-tls-Kq27-never-shown"
    srv = RedisServer(tmp_path / "auth", tls=pki, password=secret)
    caplog.set_level(logging.DEBUG)
    try:
        env = {"KVTIER_TIERS": tls_url(srv.address, pki), "KVTIER_REDIS_PASSWORD": secret}
        cfg = load_config(environ=env)
        assert secret not in repr(cfg) and secret not in str(cfg)
        tier = RedisTier(cfg.tiers[0].config, metrics)
        c = make_chunks(2)
        try:
            assert tier.store(c.objs) == 2 and fetched(tier, c.keys) == 2
        finally:
            tier.close()
        wrong = load_config(environ={**env, "KVTIER_REDIS_PASSWORD": secret + "-wrong"})
        tier = RedisTier(wrong.tiers[0].config, metrics)
        try:
            assert tier.lookup(c.keys) == 0 and fetched(tier, c.keys) == 0  # refused: misses
        finally:
            tier.close()
        assert "lookup failed" in caplog.text and secret not in caplog.text
    finally:
        srv.stop()


def test_a_cluster_over_tls(tmp_path, pki, metrics):
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            nodes.append(RedisServer(tmp_path / f"node{i}", cluster=True, tls=pki))
        subprocess.run(["redis-cli", *nodes[0].tls_args(), "--cluster", "create", *(n.address for n in nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, timeout=30, check=True)
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            assert time.monotonic() < deadline, "cluster did not come up"
            time.sleep(0.1)
        tier = open_url(tls_url(nodes[0].address, pki, cluster="true"), metrics)
        try:
            c = make_chunks(12)
            assert tier.store(c.objs) == 12
            assert tier.lookup(c.keys) == 12
            assert fetched(tier, c.keys) == 12
            assert len(tier.servers_of(c.keys)) == 3  # spread over every node
        finally:
            tier.close()
    finally:
        for n in nodes:
            n.stop()


def test_tls_settings_that_cannot_work_stop_start_up(tmp_path, pki, capsys):
    addr = "127.0.0.1:6390"
    bad_ca = tmp_path / "garbage.pem"
    bad_ca.write_text("not a certificate\n")
    locked = encrypted_copy(pki.client_key, tmp_path / "locked.key")
    cases = [
        (f"redis://{addr}?capacity=1GiB&tls_ca_file={pki.ca}", "tls_ca_file", "tls: true"),  # TLS off
        (tls_url(addr, pki, tls_ca_file=tmp_path / "absent.pem"), "tls_ca_file", "No such file"),
        (tls_url(addr, pki, tls_ca_file=bad_ca), "tls_ca_file", "PEM"),
        (tls_url(addr, pki, tls_key_file=pki.server_key), "tls_key_file", "KEY_VALUES_MISMATCH"),  # not its key
        (tls_url(addr, pki, tls_key_file=locked), "tls_key_file", "passphrase"),
        (tls_url(addr, pki, tls_cert_file=""), "tls_cert_file", "tls_key_file"),
        (f"rediss://{addr}?capacity=1GiB&tls=false", "tls", "redis://"),
    ]
    for url, key, words in cases:
        with pytest.raises(ConfigError, match=rf"tiers\[0\]\.{key}") as err:
            parse_tier(url, "tiers[0]")
        assert words in str(err.value), (url, str(err.value))
    # At the command line: exit status 2 and the key, no traceback.
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"tiers:\n  - kind: redis\n    address: {addr}\n    capacity: 1GiB\n    tls: true\n"
                   f"    tls_ca_file: {tmp_path / 'absent.pem'}\n")
    assert main(["serve", "m", "--config", str(cfg), "--launcher", "module", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "tiers[0].tls_ca_file" in err and "Traceback" not in err


def test_rediss_is_redis_with_tls(pki):
    spec = parse_tier(tls_url("127.0.0.1:6390", pki), "tiers[0]")
    assert spec.kind == "redis" and spec.config.tls and spec.config.tls_check_hostname
    assert (spec.config.tls_ca_file, spec.config.tls_cert_file) == (str(pki.ca), str(pki.client_cert))
    assert not parse_tier("redis://127.0.0.1:6390?capacity=1GiB", "t").config.tls
