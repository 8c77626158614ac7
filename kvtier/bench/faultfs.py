"""A real file system that is slow or broken on command: a FUSE passthrough.

``faultfs`` mounts a directory at another path (FUSE, through Debian's
``fuse3`` and PyPI's ``mfusepy``) and passes every operation through, except
what its control file says to do instead:

- ``read_bps``: reads go no faster than this many bytes per second, all
  readers together (a throttled or overloaded shared mount, a slow link);
- ``latency_s``: every operation waits this long first (a far server);
- ``mode``: ``ok``; ``hang`` (every operation blocks until the mode changes:
  a shared mount whose server went away); ``eio`` (every operation fails
  with EIO: a failing device); ``no-direct`` (files opened with O_DIRECT
  open, but their reads fail with EINVAL, as on file systems that accept
  the flag and refuse the I/O).

Files are opened beneath the mount without O_DIRECT whatever the caller
asked: the mount itself bypasses the page cache (below), as a network file
system's O_DIRECT does, and the reads of its own buffers need no alignment.

The control file is JSON, outside the mount, and read again whenever it
changes, so a test or a benchmark changes the mount's behaviour while kvtier
uses it (``FaultFs.set``). The mount uses FUSE's ``direct_io``: every read
reaches this process, never the kernel's page cache, so a throttle holds for
reads of pages written a moment before.

Tests and ``kvtier bench resume --throttle`` use it through ``mounted``; as a
command: ``python -m kvtier.bench.faultfs SOURCE MOUNTPOINT --control FILE``.
Needs /dev/fuse and the right to mount (root, or fuse3's fusermount3).

Threads: libfuse calls the operations from its own threads (multithreaded
mode), so that a hung operation does not stop the others from hanging too,
or from finishing once the mode changes. The throttle is one clock for all.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

_POLL_S = 0.02  # how often a hung operation looks at the control file again
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _Control:
    """The control file's current settings, re-read when its mtime changes."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp = None
        self.mode, self.read_bps, self.latency_s = "ok", 0.0, 0.0
        self._next_free = 0.0  # the throttle's clock: when the next byte may go
        self.hung = 0  # operations held by "hang" so far

    def refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                with open(self.path) as f:
                    data = json.load(f) if stamp else {}
            except (OSError, ValueError):
                return  # half-written: keep the last settings, look again next time
            self.mode = str(data.get("mode", "ok"))
            self.read_bps = float(data.get("read_bps", 0) or 0)
            self.latency_s = float(data.get("latency_s", 0) or 0)

    def enter(self) -> None:
        """At the start of every operation: hang, fail or wait as told."""
        self.refresh()
        if self.mode == "hang":
            self._count_hung()
        while self.mode == "hang":
            time.sleep(_POLL_S)
            self.refresh()
        if self.mode == "eio":
            raise OSError(errno.EIO, "faultfs: failing on command")
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _count_hung(self) -> None:
        """One more operation held: counted in ``<control>.hung`` for the
        test that wants to know whether a call reached the mount."""
        with self._lock:
            self.hung += 1
            n = self.hung
        tmp = f"{self.path}.hung.{threading.get_ident()}"
        with open(tmp, "w") as f:
            f.write(str(n))
        os.replace(tmp, f"{self.path}.hung")

    def pace(self, nbytes: int) -> None:
        """Hold a read of ``nbytes`` until the throttle lets it go."""
        if self.read_bps <= 0 or nbytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.read_bps
            wait = self._next_free - now
        time.sleep(wait)


def _operations(source: str, control: _Control):
    from mfusepy import FuseOSError, Operations

    direct: set[int] = set()  # descriptors the caller opened with O_DIRECT
    direct_lock = threading.Lock()

    class Passthrough(Operations):
        """Every call maps a mount path onto ``source``; an OSError reaches
        the caller as its errno (mfusepy's wrapper does that)."""

        use_ns = True  # times in nanoseconds, as os.stat gives them

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def access(self, path, amode):
            if not os.access(self._real(path), amode):
                raise FuseOSError(errno.EACCES)
            return 0

        def chmod(self, path, mode):
            os.chmod(self._real(path), mode)
            return 0

        def chown(self, path, uid, gid):
            os.chown(self._real(path), uid, gid)
            return 0

        def create(self, path, mode, fi=None):
            return os.open(self._real(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        def getattr(self, path, fh=None):
            st = os.fstat(fh) if path is None else os.lstat(self._real(path))
            attrs = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino")}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def link(self, target, source_):
            os.link(self._real(source_), self._real(target))
            return 0

        def mkdir(self, path, mode):
            os.mkdir(self._real(path), mode)
            return 0

        def open(self, path, flags):
            fh = os.open(self._real(path), flags & ~(os.O_CREAT | os.O_EXCL | _O_DIRECT))
            if flags & _O_DIRECT:
                with direct_lock:
                    direct.add(fh)
            return fh

        def read(self, path, size, offset, fh):
            if control.mode == "no-direct" and fh in direct:
                raise OSError(errno.EINVAL, "faultfs: O_DIRECT reads refused on command")
            data = os.pread(fh, size, offset)
            control.pace(len(data))
            return data

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._real(path))

        def readlink(self, path):
            return os.readlink(self._real(path))

        def release(self, path, fh):
            with direct_lock:
                direct.discard(fh)
            os.close(fh)
            return 0

        def rename(self, old, new):
            os.rename(self._real(old), self._real(new))
            return 0

        def rmdir(self, path):
            os.rmdir(self._real(path))
            return 0

        def statfs(self, path):
            sv = os.statvfs(self._real(path))
            return {k: getattr(sv, k) for k in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                "f_frsize", "f_namemax")}

        def symlink(self, target, source_):
            os.symlink(source_, self._real(target))
            return 0

        def truncate(self, path, length, fh=None):
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(self._real(path), length)
            return 0

        def unlink(self, path):
            os.unlink(self._real(path))
            return 0

        def utimens(self, path, times=None):
            os.utime(self._real(path), ns=times)
            return 0

        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

    # Every operation first hangs, fails or waits as the control file says
    # (release too: a hung mount hangs closing a file as well).
    for name in [n for n, v in vars(Passthrough).items() if callable(v) and not n.startswith("_")]:
        setattr(Passthrough, name, _faulty(getattr(Passthrough, name), control))
    return Passthrough()


def _faulty(op, control: _Control):
    def call(self, *args):
        control.enter()
        return op(self, *args)

    call.__name__ = op.__name__
    return call


def serve(source: str, mountpoint: str, control_path: str) -> None:
    """Mount and serve until unmounted (blocks)."""
    from mfusepy import FUSE

    control = _Control(os.path.abspath(control_path))
    FUSE(_operations(os.path.abspath(source), control), os.path.abspath(mountpoint),
         foreground=True, nothreads=False, direct_io=True, default_permissions=True,
         attr_timeout=0, entry_timeout=0, negative_timeout=0)


class FaultFs:
    """A mounted faultfs: ``path`` is the mount; ``set`` changes its behaviour."""

    def __init__(self, source: Path, path: Path, control: Path, log: Path, proc: subprocess.Popen):
        self.source, self.path, self.control, self.log, self.proc = source, path, control, log, proc

    def set(self, mode: str = "ok", read_bps: float = 0, latency_s: float = 0) -> None:
        """Behave like this from the next operation on (an operation hung
        now returns once ``mode`` is no longer ``hang``)."""
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"mode": mode, "read_bps": read_bps, "latency_s": latency_s}))
        os.replace(tmp, self.control)

    def heal(self) -> None:
        self.set()

    def hung(self) -> int:
        """Operations the mount has held in ``hang`` mode so far."""
        try:
            return int(Path(f"{self.control}.hung").read_text())
        except (OSError, ValueError):
            return 0


def available() -> str | None:
    """Why faultfs cannot mount here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when libfuse is missing
        return f"mfusepy cannot load ({exc})"
    return None


@contextlib.contextmanager
def mounted(source: str | os.PathLike, mountpoint: str | os.PathLike, timeout: float = 20.0) -> Iterator[FaultFs]:
    """``source`` mounted at ``mountpoint`` by a faultfs process of its own,
    healthy at first; healed, unmounted and stopped on the way out."""
    why = available()
    if why:
        raise RuntimeError(f"faultfs cannot mount: {why}")
    source, mnt = Path(source).resolve(), Path(mountpoint).resolve()
    mnt.mkdir(parents=True, exist_ok=True)
    control = mnt.parent / f".{mnt.name}.faultfs.json"
    control.write_text("{}")
    log = mnt.parent / f".{mnt.name}.faultfs.log"  # a file, never a pipe nobody drains
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.faultfs", str(source), str(mnt),
                                 "--control", str(control)], stdout=out, stderr=out)
    fs = FaultFs(source, mnt, control, log, proc)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if proc.poll() is not None:
                raise RuntimeError(f"faultfs exited: {log.read_text(errors='replace').strip()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"faultfs did not mount {mnt} within {timeout:.0f} s")
            time.sleep(0.05)
        yield fs
    finally:
        fs.heal()
        _unmount(mnt)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        control.unlink(missing_ok=True)
        Path(f"{control}.hung").unlink(missing_ok=True)


def _unmount(mnt: Path) -> None:
    for args in (["-u"], ["-uz"]):  # lazily, if something still holds it
        for _ in range(50):
            if not os.path.ismount(mnt):
                return
            if subprocess.run(["fusermount3", *args, str(mnt)], capture_output=True).returncode == 0:
                return
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtier.bench.faultfs", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="the directory to pass through")
    ap.add_argument("mountpoint", help="where to mount it")
    ap.add_argument("--control", required=True, help="JSON control file: mode (ok|hang|eio), read_bps, latency_s")
    args = ap.parse_args(argv)
    serve(args.source, args.mountpoint, args.control)


if __name__ == "__main__":
    main()
