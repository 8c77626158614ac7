"""The Redis tier's read path: a GET whose value goes from the socket
straight into a pooled buffer.

redis-py hands every value over as a ``bytes`` object: its parser (hiredis
too) collects the reply in a buffer of its own and copies it into a new
``bytes``, which the tier then copies into a pooled buffer: for a 3 MiB chunk,
three copies and a fresh 3 MiB allocation per read, most of them under the
GIL. Here the reply's header is read first, then the value is received
directly into the pooled buffer (``recv_into``, the GIL released): the only
copy is the kernel's (see docs/deploy.md for what it measured).

A ``ReadConnection`` speaks only what kvtier's reads need of RESP2: the
handshake (``AUTH``, ``SELECT``), ``GET``/``GETEX`` and their replies (a
bulk string, nil, or an error). Lookups, stores, scripts and the cluster's
slot map stay with redis-py, whose settings (timeouts, ACL user and password,
TLS as ``tls`` sets it up, database) these connections share.

Threads: a connection is used by one thread at a time: taken from its
``ReadPool``, given back only after a complete reply. One that saw an error,
a timeout or a malformed reply is closed, never given back (its position in
the stream is unknown); an idle one the server closed meanwhile (a restart)
is dropped when next taken. The pool is made per process: a forked child never
uses its parent's sockets.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
from typing import Any

from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from kvtier.buffers import BufferPool, align_up
from kvtier.errors import CorruptObject
from kvtier.tiers.redis import tls as redis_tls

_MAX_LINE = 4096  # longest status or error line read (Redis' are far shorter)


class Redirected(ResponseError):
    """A cluster node answered MOVED or ASK: the slot is served elsewhere."""


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


class ReadConnection:
    """One socket to one server, connected and authenticated on creation."""

    def __init__(self, host: str, port: int, config: Any, tls: ssl.SSLContext | None = None):
        """``tls``: the context of a TLS connection (``tls.context``)."""
        sock = socket.create_connection((host, port), timeout=config.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
            sock.settimeout(config.socket_timeout_s)
            self.sock = sock
            self._line = bytearray(_MAX_LINE)
            if config.password:
                user = [config.username.encode()] if config.username else []
                self._ok(_command(b"AUTH", *user, config.password.encode()), "AUTH")
            if config.db:
                self._ok(_command(b"SELECT", str(config.db).encode()), "SELECT")
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _ok(self, cmd: bytes, what: str) -> None:
        self.sock.sendall(cmd)
        line, _ = self._read_line(self._line_view())
        if bytes(line[:3]) != b"+OK":
            # The server's own words name the problem (WRONGPASS, NOPERM, ...);
            # they never echo the password.
            text = bytes(line[1:120]).decode(errors="replace")
            raise (AuthenticationError if what == "AUTH" else ResponseError)(f"{what} refused: {text}")

    def _line_view(self) -> memoryview:
        return memoryview(self._line)

    def _read_line(self, view: memoryview) -> tuple[memoryview, memoryview]:
        """Receive until the first CRLF; returns (the line without CRLF, what
        was received after it)."""
        got = 0
        while True:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise RedisConnectionError("connection closed by the server")
            start = max(0, got - 1)
            got += n
            end = bytes(view[start:got]).find(b"\r\n")
            if end >= 0:
                end += start
                return view[:end], view[end + 2 : got]
            if got == len(view):
                raise RedisConnectionError("reply line too long")

    def get_into(self, name: bytes, pool: BufferPool, max_len: int, px: int | None = None) -> tuple[memoryview, int] | None:
        """``GET name`` (``GETEX name PX px`` with ``px``): None if there is
        no such key, else a buffer from ``pool`` (its size aligned up) and
        the value's length. A value longer than ``max_len`` raises
        CorruptObject, unread. Raises redis-py's errors (and OSError) for
        trouble: the connection is then unusable."""
        if px:
            self.sock.sendall(_command(b"GETEX", name, b"PX", str(px).encode()))
        else:
            self.sock.sendall(_command(b"GET", name))
        line, rest = self._read_line(self._line_view())
        kind = bytes(line[:1])
        if kind == b"-":
            text = bytes(line[1:]).decode(errors="replace")
            if text.startswith(("MOVED ", "ASK ")):
                raise Redirected(text)
            raise ResponseError(text)
        if kind != b"$":
            raise RedisConnectionError(f"unexpected reply {bytes(line[:16])!r}")
        n = int(bytes(line[1:]))
        if n < 0:
            return None
        if n > max_len:
            raise CorruptObject(f"value size {n} out of range")
        buf = pool.get(align_up(n))
        try:
            # What came with the header line: the value's first bytes, maybe
            # all of it and its CRLF.
            have = min(n, rest.nbytes)
            buf[:have] = rest[:have]
            tail = rest.nbytes - have  # bytes of the final CRLF already here
            sock = self.sock
            while have < n:
                got = sock.recv_into(buf[have:n], n - have)
                if not got:
                    raise RedisConnectionError("connection closed by the server")
                have += got
            while tail < 2:
                got = sock.recv_into(self._line_view()[tail:2], 2 - tail)
                if not got:
                    raise RedisConnectionError("connection closed by the server")
                tail += got
        except BaseException:
            pool.put(buf)
            raise
        return buf, n


def _alive(sock: socket.socket) -> bool:
    """An idle connection is usable only while nothing can be read from it:
    a server that closed it (restart, idle timeout) makes it readable (EOF).
    redis-py checks its own pooled connections the same way."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


class ReadPool:
    """Idle ``ReadConnection``s per server, at most ``max_idle`` each."""

    def __init__(self, config: Any, max_idle: int):
        self.config = config
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[ReadConnection]] = {}
        self._pid = os.getpid()
        self._closed = False
        self._tls: ssl.SSLContext | None = None  # made with the first connection (it reads the files)

    def get_into(self, host: str, port: int, name: bytes, pool: BufferPool, max_len: int,
                 px: int | None = None) -> tuple[memoryview, int] | None:
        conn = self._take(host, port)
        try:
            out = conn.get_into(name, pool, max_len, px)
        except BaseException:
            conn.close()
            raise
        self._give(host, port, conn)
        return out

    def _take(self, host: str, port: int) -> ReadConnection:
        with self._lock:
            if self._closed:
                raise RedisConnectionError("tier is closed")
            if self._pid != os.getpid():  # forked: the parent's sockets are not ours
                self._idle, self._pid = {}, os.getpid()
            idle = self._idle.get((host, port))
            while idle:
                conn = idle.pop()
                if _alive(conn.sock):
                    return conn
                conn.close()  # the server closed it (restarted, timed it out): never reused
            if self.config.tls and self._tls is None:
                self._tls = redis_tls.context(self.config)
            tls = self._tls
        return ReadConnection(host, port, self.config, tls)

    def _give(self, host: str, port: int, conn: ReadConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if not self._closed and self._pid == os.getpid() and len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle] if self._pid == os.getpid() else []
            self._idle = {}
        for c in conns:
            c.close()
