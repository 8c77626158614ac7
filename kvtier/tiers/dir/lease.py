"""The shared directory tier's collector lease: at most one collection pass
per store at a time (``collector.Leases`` for a directory).

``<base>/gc.lease`` holds the holder's host, pid, time and a random token.
It is written in full under a temporary name and published with ``link``
(atomic, fails if a lease exists). A lease is stale once its holder's process
is gone (same host) or it is older than ``lease_s``; a stale lease is taken
over by renaming it to a unique name first (one of several racing renames
wins). A holder releases only a lease that still carries its token. The lease
has no deadline of its own: a pass that holds it runs to its end.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.layout import HOST, pid_alive

LEASE_NAME = "gc.lease"


@dataclass(frozen=True)
class DirLease:
    path: Path
    token: str

    def valid(self) -> bool:
        return True


class DirLeases:
    def __init__(self, odir: ObjectDir, lease_s: float):
        self._dir = odir
        self._lease_s = lease_s
        self.path = odir.base / LEASE_NAME

    def take(self) -> DirLease | None:
        """The lease, or None while another live collector holds it."""
        token = self.take_at(self.path)
        return None if token is None else DirLease(self.path, token)

    def release(self, lease: DirLease) -> None:
        _release_lease(lease.path, lease.token)

    def take_at(self, lease: Path) -> str | None:
        """Take the collector lease; returns its token, or None if another live
        collector holds it.

        The lease is written in full under a temporary name and published with
        ``link`` (atomic, fails if a lease exists), so nobody ever reads a
        half-written lease. A stale lease is taken over by renaming it to a
        unique name first: of several collectors racing for it, one rename
        wins. Two collectors running at once is still safe (deletes are
        idempotent); the lease only spares redundant work.
        """
        token = secrets.token_hex(8)
        body = json.dumps({"host": HOST, "pid": os.getpid(), "time": time.time(), "token": token}).encode()
        tmp = self._dir.tmp / f"{HOST}.{os.getpid()}.{token}.lease"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        try:
            for _ in range(2):
                try:
                    os.link(tmp, lease)
                    return token
                except FileExistsError:
                    stale = self._stale(lease)
                    if stale is None:
                        return None
                    grave = lease.with_name(f"gc.lease.{token}.stale")
                    try:
                        os.rename(lease, grave)
                    except FileNotFoundError:
                        continue  # released or taken meanwhile: try again
                    if _lease_token(grave) != stale:
                        # We moved a fresh lease someone took meanwhile: put it back.
                        try:
                            os.link(grave, lease)
                        except FileExistsError:
                            pass
                        _release_lease(grave)
                        return None
                    _release_lease(grave)
            return None
        finally:
            _release_lease(tmp)

    def _stale(self, lease: Path) -> str | None:
        """The token of an abandoned lease, or None if its holder is alive."""
        try:
            info = json.loads(lease.read_bytes())
            age = time.time() - float(info["time"])
            same_host_dead = info.get("host") == HOST and not pid_alive(int(info["pid"]))
            if same_host_dead or age > self._lease_s:
                return str(info.get("token", ""))
            return None
        except FileNotFoundError:
            return ""
        except (OSError, ValueError, KeyError, TypeError):
            # Unreadable (kvtier publishes leases whole, but a foreign or older
            # writer may not): abandoned only once it is older than a lease.
            try:
                return "" if time.time() - lease.stat().st_mtime > self._lease_s else None
            except OSError:
                return ""


def _release_lease(lease: Path, token: str | None = None) -> None:
    """Remove a lease file; with ``token``, only if it is still ours."""
    if token is not None and _lease_token(lease) != token:
        return
    try:
        os.unlink(lease)
    except FileNotFoundError:
        pass


def _lease_token(lease: Path) -> str:
    try:
        return str(json.loads(lease.read_bytes()).get("token", ""))
    except (OSError, ValueError, AttributeError):
        return ""
