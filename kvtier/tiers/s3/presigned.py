"""The S3 tier's read path: GETs and HEADs of single objects as plain HTTP
requests to URLs the tier's boto3 client presigns, each body received
straight into a pooled buffer.

A boto3 ``get_object`` or ``head_object`` spends milliseconds of client
CPU before the first body byte (parameter handling, the event system,
signing, urllib3): for a 3 MiB chunk, most of the client's work. Presigning
the same request with the same client (``generate_presigned_url``: its
endpoint, addressing style, region and credentials chain) and sending it
over a kept-alive ``http.client`` connection costs less, and ``readinto``
fills the pooled buffer without an intermediate copy (docs/deploy.md has
the measurements).

Only the common answers are handled here: 200 (the object), 404 (a miss).
Any other status (a redirect to another region, throttling, a server error,
refused credentials) is ``Unhandled``: the tier repeats that call through
boto3, whose retries and errors then apply. A connection that
fails is closed, never reused; one kept alive that the server had closed
meanwhile is retried once on a fresh connection (no request was served).
Timeouts: ``connect_timeout_s`` to connect, ``read_timeout_s`` per socket
read, as boto3's. TLS: verified against ``ca_bundle`` (else
``AWS_CA_BUNDLE``, else botocore's bundle) unless ``verify_tls`` is false.
Where a proxy is configured for the endpoint (``HTTP(S)_PROXY``), this path
is off and every call goes through boto3.

Threads: any thread may call; a connection is used by one thread at a time
(taken from the pool, given back after a complete response). The pool is
per process: a forked child never uses its parent's sockets.
"""

from __future__ import annotations

import http.client
import os
import select
import ssl
import threading
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any, Callable
from urllib.parse import quote, unquote, urlsplit

from kvtier.buffers import BufferPool, align_up
from kvtier.errors import CorruptObject

# What a kept-alive connection the server closed looks like on its next use.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.BadStatusLine)
HTTP_ERRORS = (OSError, http.client.HTTPException)  # trouble on this path (timeouts are OSErrors)
_URL_TTL_S = 900  # presigned URLs are used at once; this only bounds a leak's reach


class Unhandled(Exception):
    """A status this path does not interpret: repeat the call through boto3."""


def enabled(endpoint: str | None) -> bool:
    """False where requests to ``endpoint`` must go through a proxy (boto3
    honours proxies; this path does not)."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return True
    if not endpoint:
        return "https" not in proxies
    parts = urlsplit(endpoint)
    return parts.scheme not in proxies or bool(urllib.request.proxy_bypass(parts.hostname or ""))


_UNKNOWN = object()
# The query parameters of the presigned GETs ``QuerySigner`` makes itself
# (SigV4; and SigV2, which botocore presigns with in us-east-1 or without a
# region unless told otherwise); a client that adds any other keeps
# presigning through boto3.
_SIGV4_QUERY = {"X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders",
                "X-Amz-Signature", "X-Amz-Security-Token"}
_SIGV2_QUERY = {"AWSAccessKeyId", "Signature", "Expires", "x-amz-security-token"}
_PROBE = "kvtier-presign-probe"


class QuerySigner:
    """Presigns requests for the objects of one bucket as the tier's boto3
    client would, at a fraction of the CPU: the client's
    ``generate_presigned_url`` wraps botocore's query signer in parameter
    handling, endpoint rules and events, and a load presigns twice per chunk
    (HEAD, GET).

    ``learn`` presigns one probe URL through the client and keeps what comes
    before the key (scheme, host, addressing style, bucket), the signing
    region from its credential scope (SigV4), and the client's credentials object
    (botocore's ``_request_signer._credentials``, a private attribute: if a
    botocore release drops it, or the client presigns otherwise than SigV4
    with only the usual parameters, ``learn`` returns None and the tier
    presigns through the client). Refreshable credentials are
    frozen per URL, as botocore does. The signature is botocore's own
    (``S3SigV4QueryAuth``, ``HmacV1QueryAuth``); tests compare its URLs with
    the client's.
    """

    def __init__(self, base: str, region: str | None, credentials: Any):
        """``region`` None: SigV2."""
        self._base, self._region, self._credentials = base, region, credentials

    @classmethod
    def learn(cls, client: Any, bucket: str) -> "QuerySigner | None":
        try:
            url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": _PROBE},
                                                ExpiresIn=_URL_TTL_S)
            credentials = client._request_signer._credentials
        except Exception:  # noqa: BLE001 - any surprise: keep presigning through the client
            return None
        path, _, query = url.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        if credentials is None or not path.endswith("/" + _PROBE):
            return None
        base = path[: -len(_PROBE)]
        if "X-Amz-Algorithm" in params:
            scope = unquote(params.get("X-Amz-Credential", "")).split("/")
            if (set(params) <= _SIGV4_QUERY and params["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
                    and len(scope) == 5 and scope[3] == "s3"):
                return cls(base, scope[2], credentials)
            return None
        if set(params) <= _SIGV2_QUERY and {"AWSAccessKeyId", "Signature", "Expires"} <= set(params):
            return cls(base, None, credentials)
        return None

    def sign(self, method: str, key: str) -> str:
        from botocore.auth import HmacV1QueryAuth, S3SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=self._base + quote(key, safe="/~"))
        frozen = self._credentials.get_frozen_credentials()
        if self._region is None:
            HmacV1QueryAuth(frozen, expires=_URL_TTL_S).add_auth(request)
        else:
            S3SigV4QueryAuth(frozen, "s3", self._region, expires=_URL_TTL_S).add_auth(request)
        return request.url


class PresignedHTTP:
    """Presigned GET/HEAD of one object at a time; ``client`` returns the
    tier's boto3 client (made anew in a forked child)."""

    def __init__(self, config: Any, client: Callable[[], Any], max_idle: int):
        self.config = config
        self._client = client
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._pid = os.getpid()
        self._ssl: ssl.SSLContext | None = None
        self._signers: dict[str, QuerySigner | None] = {}  # per bucket; None: presign through the client
        self._signers_of: Any = None  # the client they were learnt from

    # ------------------------------------------------------------ requests
    def head(self, bucket: str, name: str) -> tuple[int, float] | None:
        """(size, LastModified) or None for a miss; raises Unhandled or HTTP_ERRORS."""
        with self._request("HEAD", "head_object", bucket, name) as (resp, _):
            resp.read()  # no body: ends the response, so the connection can be reused
            if resp.status == 404:
                return None
            return int(resp.getheader("Content-Length", "0")), _last_modified(resp)

    def get_into(self, bucket: str, name: str, pool: BufferPool, max_len: int) -> tuple[memoryview, int, float] | None:
        """None for a miss, else a buffer from ``pool`` (size aligned up)
        holding the object, its length and LastModified. An object longer
        than ``max_len`` raises CorruptObject, unread."""
        with self._request("GET", "get_object", bucket, name) as (resp, conn):
            if resp.status == 404:
                resp.read()
                return None
            n = int(resp.getheader("Content-Length", "-1"))
            if n < 0:
                raise Unhandled("no Content-Length")  # (the connection is closed on the way out)
            if n > max_len:
                raise CorruptObject(f"object size {n} out of range")  # unread: the connection is closed
            buf = pool.get(align_up(n))
            try:
                got = 0
                while got < n:
                    k = resp.readinto(buf[got:n])
                    if not k:
                        raise http.client.IncompleteRead(bytes(), n - got)
                    got += k
            except BaseException:
                pool.put(buf)
                raise
            return buf, n, _last_modified(resp)

    def _request(self, method: str, op: str, bucket: str, name: str) -> "_Exchange":
        url = self.presign(method, op, bucket, name)
        parts = urlsplit(url)
        target = parts.path + ("?" + parts.query if parts.query else "")
        where = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        return _Exchange(self, where, method, target)

    def presign(self, method: str, op: str, bucket: str, name: str) -> str:
        """The presigned URL of one request. Signed by ``QuerySigner`` (the
        URL the client builds for ``bucket``, signed with botocore's own
        SigV4 query signer) where the client presigns that way, else by the
        client's ``generate_presigned_url``."""
        client = self._client()
        with self._lock:
            if self._signers_of is not client:  # a new client (forked child): learn again
                self._signers, self._signers_of = {}, client
            signer = self._signers.get(bucket, _UNKNOWN)
        if signer is _UNKNOWN:
            signer = QuerySigner.learn(client, bucket)
            with self._lock:
                self._signers[bucket] = signer
        if signer is None:
            return client.generate_presigned_url(op, Params={"Bucket": bucket, "Key": name}, ExpiresIn=_URL_TTL_S)
        return signer.sign(method, name)

    # ------------------------------------------------------------ connections
    def _take(self, where: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._idle, self._pid = {}, os.getpid()
            idle = self._idle.get(where)
            while idle:
                conn = idle.pop()
                if _alive(conn):
                    return conn, True
                conn.close()  # the server closed it (restart, idle timeout): never reused
        scheme, host, port = where
        c = self.config
        if scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=c.connect_timeout_s, context=self._tls())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=c.connect_timeout_s)
        return conn, False

    def _give(self, where: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if self._pid == os.getpid() and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = tls_context(self.config)
        return self._ssl

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle] if self._pid == os.getpid() else []
            self._idle = {}
        for conn in conns:
            conn.close()


class _Exchange:
    """One request and its response on a pooled connection (a context
    manager): the response is handed over with status 200 or 404, any other
    raises Unhandled; the connection goes back to the pool only when the
    response was read to its end and the server keeps it open."""

    def __init__(self, owner: PresignedHTTP, where: tuple[str, str, int], method: str, target: str):
        self.owner, self.where, self.method, self.target = owner, where, method, target
        self.conn: http.client.HTTPConnection | None = None
        self.resp: http.client.HTTPResponse | None = None

    def __enter__(self) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
        for attempt in (0, 1):
            conn, reused = self.owner._take(self.where)
            try:
                conn.request(self.method, self.target)
                if conn.sock is not None:
                    conn.sock.settimeout(self.owner.config.read_timeout_s)
                resp = conn.getresponse()
            except _STALE:
                conn.close()
                if reused and attempt == 0:
                    continue  # the server had closed it while idle: nothing was served
                raise
            except BaseException:
                conn.close()
                raise
            self.conn, self.resp = conn, resp
            if resp.status not in (200, 404):
                resp.read()  # small: an error document
                self._release()
                raise Unhandled(f"HTTP {resp.status}")
            return resp, conn
        raise AssertionError("unreachable")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if self.conn is not None:
                self.conn.close()
            return
        self._release()

    def _release(self) -> None:
        conn, resp = self.conn, self.resp
        if conn is None or resp is None:
            return
        if resp.isclosed() and not resp.will_close and conn.sock is not None:
            self.owner._give(self.where, conn)
        else:
            conn.close()


def _alive(conn: http.client.HTTPConnection) -> bool:
    """An idle connection is usable only while nothing can be read from it:
    a server that closed it (restart, keep-alive timeout) makes it readable."""
    if conn.sock is None:
        return False
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def tls_context(config: Any) -> ssl.SSLContext:
    """Certificate checks as the tier's boto3 client makes them: against
    ``ca_bundle``, else ``AWS_CA_BUNDLE``, else botocore's bundle; none with
    ``verify_tls: false``."""
    if not config.verify_tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    from botocore.httpsession import where as botocore_bundle

    return ssl.create_default_context(cafile=config.ca_bundle or os.environ.get("AWS_CA_BUNDLE") or botocore_bundle())


def _last_modified(resp: http.client.HTTPResponse) -> float:
    value = resp.getheader("Last-Modified")
    try:
        return parsedate_to_datetime(value).timestamp() if value else 0.0
    except (TypeError, ValueError):
        return 0.0
