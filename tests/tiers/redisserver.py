"""A real ``redis-server`` for the tests.

``RedisServer`` starts one server on a free loopback port (no persistence,
a temporary directory; TLS-only with ``tls``) and stops it by its own PID; the contract harness
(``harness_redis``), ``test_redis.py`` (single servers and cluster nodes) and
the end-to-end tests use it. It lives apart from the harness because
``harness`` imports every ``harness_*`` module while it is itself imported.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from tests.tiers.tlscerts import Pki

REDIS_SERVER = shutil.which("redis-server")


def free_port(bus: bool = False) -> int:
    """A loopback port free now (and, for cluster nodes, port + 10000 too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


class RedisServer:
    """One redis-server process bound to 127.0.0.1, owned by a test."""

    def __init__(self, dir_: Path, port: int | None = None, cluster: bool = False, password: str = "",
                 tls: Pki | None = None):
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed (make sysdeps installs it)")
        self.dir = dir_
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.password = password  # requirepass: clients must AUTH
        # TLS only (no plain port), client certificates required (tls-auth-clients
        # yes, Redis' default), signed by tls.ca; a cluster's bus uses TLS too.
        self.tls = tls
        self.port = port or free_port(bus=cluster)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.dir), "--protected-mode", "yes", "--loglevel", "warning",
        ]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(self.tls.server_cert), "--tls-key-file", str(self.tls.server_key),
                     "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "yes"]
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
        log = open(self.dir / "server.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {(self.dir / 'server.log').read_text()[-500:]}")
                if self.ping():
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer in time")
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise

    def ping(self) -> bool:
        try:
            with self._connect() as s:
                if self.password:
                    s.sendall(b"AUTH " + self.password.encode() + b"\r\n")
                    if not s.recv(16).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if not self.tls:
            return s
        ctx = ssl.create_default_context(cafile=str(self.tls.ca))
        ctx.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return ctx.wrap_socket(s, server_hostname="127.0.0.1")

    def tls_args(self) -> list[str]:
        """redis-cli's options to reach this server."""
        if not self.tls:
            return []
        return ["--tls", "--cacert", str(self.tls.ca), "--cert", str(self.tls.client_cert), "--key", str(self.tls.client_key)]

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *self.tls_args(), *args],
            capture_output=True, timeout=10, check=True,
            env={**os.environ, "REDISCLI_AUTH": self.password} if self.password else None,  # not on the command line
        )
        return out.stdout.decode()

    def stop(self) -> None:
        """Kill the server (SIGKILL: no shutdown work, like a crash) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
