"""What a network tier's server can deliver, measured in the same run as
kvtier's loads: the ceiling ``kvtier bench storage --tier`` compares them
with, as fio is for directories.

- Redis/Valkey: the server's own ``redis-benchmark`` (Debian ``redis-tools``)
  GETting the benchmark's own objects (the same value size, the same server,
  nothing written) with as many connections as kvtier has reads in flight. On
  a cluster, one ``redis-benchmark`` per master runs at once, each GETting an
  object that master serves, the connections split over them.
- S3: plain parallel GETs of the same objects, nothing verified or copied
  after the read, with as many in flight as kvtier, through three clients:
  boto3 ``get_object`` (threads, each body read into a buffer of its own);
  URLs presigned for boto3's client (as kvtier's reads sign them) and
  fetched with ``http.client`` over kept-alive
  connections (the request path kvtier's S3 tier uses for its reads); and,
  where ``awscrt`` is installed, the AWS common runtime's S3 client (C, its
  own event loop). The fastest is the ceiling; all are reported.

CPU seconds are the client's (user + system): redis-benchmark's from the
kernel's accounting of the child (``RUSAGE_CHILDREN``), the in-process S3
clients' from this process's, like kvtier's own loads.
"""

from __future__ import annotations

import csv
import http.client
import io
import ssl
import resource
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence
from urllib.parse import urlsplit

from kvtier.buffers import alloc
from kvtier.bench.storage_common import LoadPass, cpu_seconds
from kvtier.tiers.s3.presigned import QuerySigner


class CeilingMissing(RuntimeError):
    """The tool that measures the ceiling is not installed (the message says
    how to install it); the benchmark skips the ceiling only."""


def concurrency(window: int, object_bytes: int, threads: int) -> int:
    """Reads kvtier keeps in flight at ``window``: as many objects as fit in
    the window (one always does), at most one per I/O thread (``ReadStream``)."""
    return max(1, min(threads, window // max(1, object_bytes)))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------- Redis


def redis_benchmark_exe() -> str:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise CeilingMissing("redis-benchmark is not installed (Debian redis-tools: apt-get install redis-tools; "
                             "make sysdeps installs it)")
    return exe


def redis_benchmark_version() -> str:
    out = subprocess.run([redis_benchmark_exe(), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or out.stderr.strip()


def redis_get_ceiling(config: Any, targets: Sequence[tuple[str, int, bytes]], value_bytes: int, clients: int,
                      requests: int) -> LoadPass:
    """``redis-benchmark`` GETs: ``targets`` are (host, port, object name),
    one per server to load (a cluster's masters), each GET returning
    ``value_bytes``; ``clients`` connections and ``requests`` GETs in all,
    split over the targets and run at once. ``config`` is the tier's
    ``RedisConfig`` (credentials, TLS, database). Raises CeilingMissing or
    RuntimeError (the tool failed; its message)."""
    exe = redis_benchmark_exe()
    shares = [clients // len(targets) + (1 if i < clients % len(targets) else 0) for i in range(len(targets))]
    cmds = []
    for (host, port, name), c in zip(targets, shares):
        if c == 0:
            continue
        n = max(c, requests * c // clients)
        cmd = [exe, "-h", host, "-p", str(port), "-c", str(c), "-n", str(n), "--csv"]
        if config.password:
            # redis-benchmark takes a password only on its command line (it
            # reads no REDISCLI_AUTH): visible in the process list while it
            # runs. The command line is never printed or logged.
            cmd += ["-a", config.password] + (["--user", config.username] if config.username else [])
        if config.db:
            cmd += ["--dbnum", str(config.db)]
        if config.tls:
            cmd += ["--tls"] + (["--cacert", config.tls_ca_file] if config.tls_ca_file else [])
            if config.tls_cert_file:
                cmd += ["--cert", config.tls_cert_file, "--key", config.tls_key_file or config.tls_cert_file]
        cmds.append((cmd + ["GET", name.decode()], n))
    c0, t0 = _children_cpu(), time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd, _ in cmds]
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    cpu = _children_cpu() - c0
    rates = []
    for p, (out, err), _ in zip(procs, outs, cmds):
        if p.returncode != 0:
            raise RuntimeError(f"redis-benchmark failed ({p.returncode}): {(err or out).strip()[:300]}")
        rates.append(_csv_rps(out, err))
    nbytes = sum(n for _, n in cmds) * value_bytes
    return LoadPass(nbytes, concurrent_seconds([n for _, n in cmds], rates, wall), cpu)


def concurrent_seconds(requests: Sequence[int], rates: Sequence[float], wall: float) -> float:
    """How long runs started at once took to serve ``requests`` GETs between
    them, each at its own measured rate: the longest run (each tool's clock
    starts once its connections are up). Not the sum of the rates, which
    overstates the servers whenever one run ended before another (the others
    then had the client's CPU to themselves). Where a millisecond clock saw
    no time pass (rate "inf"), ``wall``, process start included."""
    if any(not 0 < r < float("inf") for r in rates):
        return wall
    return max(n / r for n, r in zip(requests, rates))


def _csv_rps(out: str, err: str) -> float:
    """Requests per second from ``redis-benchmark --csv``: a header row
    ("test","rps",...) then one row per test."""
    if "error" in err.lower() or "MOVED" in err:
        raise RuntimeError(f"redis-benchmark got errors from the server: {err.strip()[:300]}")
    rows = [r for r in csv.reader(io.StringIO(out)) if r]
    for row in rows:
        if row[0] != "test" and len(row) > 1:
            try:
                return float(row[1])
            except ValueError:
                continue
    raise RuntimeError(f"cannot read redis-benchmark's output: {(out or err).strip()[:300]}")


# ---------------------------------------------------------------- S3


def s3_boto3_ceiling(client: Any, bucket: str, names: Sequence[str], object_bytes: int, clients: int) -> LoadPass:
    """Plain GETs of ``names`` (each ``object_bytes`` long), ``clients`` at
    once, through a boto3 client: each body read straight into a buffer of
    the reading thread. Nothing else is done with the bytes."""
    bufs = [alloc(object_bytes, populate=True) for _ in range(clients)]
    slot = threading.local()
    free = list(range(clients))
    lock = threading.Lock()

    def get(name: str) -> int:
        if not hasattr(slot, "buf"):
            with lock:
                slot.buf = bufs[free.pop()]
        r = client.get_object(Bucket=bucket, Key=name)
        body, got = r["Body"], 0
        try:
            view = slot.buf
            while True:
                n = body.readinto(view[got:])
                if not n:
                    break
                got += n
        finally:
            body.close()
        return got

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(get, names[: clients]))  # connections up, as kvtier's pool has them
        c0, t0 = cpu_seconds(), time.perf_counter()
        nbytes = sum(pool.map(get, names))
        return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)


def s3_presigned_ceiling(client: Any, bucket: str, names: Sequence[str], object_bytes: int, clients: int,
                         tls: "ssl.SSLContext | None" = None) -> LoadPass:
    """Plain GETs of URLs presigned for a boto3 client, sent over one
    kept-alive ``http.client`` connection per thread, each body read straight
    into a buffer of the reading thread. URLs are signed the cheapest way
    kvtier knows, as its own reads sign them (``presigned.QuerySigner``, else
    the client's ``generate_presigned_url``)."""
    local = threading.local()
    signer = QuerySigner.learn(client, bucket)

    def get(name: str) -> int:
        url = urlsplit(signer.sign("GET", name) if signer is not None else
                       client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": name}, ExpiresIn=900))
        if not hasattr(local, "conn"):
            local.buf = alloc(object_bytes, populate=True)
            local.conn = (http.client.HTTPSConnection(url.hostname, url.port or 443, timeout=30, context=tls)
                          if url.scheme == "https" else http.client.HTTPConnection(url.hostname, url.port or 80, timeout=30))
        local.conn.request("GET", f"{url.path}?{url.query}")
        resp = local.conn.getresponse()
        if resp.status != 200:
            resp.read()
            raise RuntimeError(f"GET {name}: HTTP {resp.status}")
        got, view = 0, local.buf
        while True:
            n = resp.readinto(view[got:])
            if not n:
                break
            got += n
        resp.read()
        return got

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(get, names[:clients]))  # connections up
        c0, t0 = cpu_seconds(), time.perf_counter()
        nbytes = sum(pool.map(get, names))
        return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)


def awscrt_available() -> bool:
    try:
        import awscrt.s3  # noqa: F401
    except ImportError:
        return False
    return True


def s3_crt_ceiling(endpoint: str, region: str, bucket: str, names: Sequence[str], object_bytes: int, clients: int,
                   access_key: str | None, secret_key: str | None) -> LoadPass:
    """Plain GETs through the AWS common runtime's S3 client (awscrt):
    ``clients`` requests in flight, each body copied into one buffer per
    request slot by the client's body callback."""
    from awscrt import auth, http, io as crt_io, s3

    parts = urlsplit(endpoint)
    elg = crt_io.EventLoopGroup(1)
    resolver = crt_io.DefaultHostResolver(elg)
    bootstrap = crt_io.ClientBootstrap(elg, resolver)
    if access_key:
        creds = auth.AwsCredentialsProvider.new_static(access_key, secret_key)
    else:
        creds = auth.AwsCredentialsProvider.new_default_chain(bootstrap)
    tls = s3.S3RequestTlsMode.ENABLED if parts.scheme == "https" else s3.S3RequestTlsMode.DISABLED
    crt = s3.S3Client(bootstrap=bootstrap, region=region, credential_provider=creds, tls_mode=tls,
                      part_size=max(object_bytes, 5 << 20), throughput_target_gbps=10.0)
    host = parts.netloc
    bufs = [alloc(object_bytes, populate=True) for _ in range(clients)]

    def one(name: str, buf: memoryview) -> tuple[Any, list[int]]:
        got = [0]

        def on_body(chunk, offset, **kw):
            n = len(chunk)
            buf[offset:offset + n] = chunk
            got[0] += n

        headers = http.HttpHeaders([("host", host)])
        req = http.HttpRequest("GET", f"/{bucket}/{name}", headers)
        fut = crt.make_request(type=s3.S3RequestType.GET_OBJECT, request=req, on_body=on_body).finished_future
        return fut, got

    def run(batch: Sequence[str]) -> int:
        total, queue, inflight = 0, list(batch), []
        free = list(range(clients))
        while queue or inflight:
            while queue and free:
                i = free.pop()
                inflight.append((i, *one(queue.pop(0), bufs[i])))
            i, fut, got = inflight.pop(0)
            fut.result(60)
            total += got[0]
            free.append(i)
        return total

    run(names[:clients])
    c0, t0 = cpu_seconds(), time.perf_counter()
    nbytes = run(names)
    return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)
