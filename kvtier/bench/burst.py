"""The device's own rate for loads of one session's size: ``kvtier bench
storage``'s "device, one load at once" line.

fio's best job streams long files with the kernel's readahead keeping many
megabytes in flight on many streams for the whole run. A cold load is one
session's objects, 24 MiB at 2k tokens of a 0.5B model: whatever reads it,
no more than those bytes can be in flight, and the load waits for its first
and its last bytes. This reads each session's object files as a load would
if nothing else cost anything: every file opened with O_DIRECT, all of them
submitted at once through native AIO into buffers on huge pages, reaped,
closed; no checksum, no header, no thread but the caller's. What it reaches
is the ceiling of a load that size on this device, and what it costs is
the kernel's part of such reads: the two figures that show whether a cold
load is held back by kvtier or by the device.

Not a kvtier read path: nothing is verified, so nothing here may serve
data.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from kvtier.bench.storage_common import LoadPass, StorageBenchError, cpu_seconds
from kvtier.buffers import address, align_up, alloc
from kvtier.tiers.dir import aio

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def why_not() -> str:
    """Why the burst cannot be measured here ("" if it can)."""
    if not _O_DIRECT:
        return "this platform has no O_DIRECT"
    if not aio.available():
        return "native AIO is not available"
    return ""


class Burst:
    """Reads sessions of object files, each session's all at once. Holds one
    AIO context and a buffer per object of the largest session (``close``)."""

    def __init__(self, sessions: Sequence[Sequence[str]], file_bytes: int, payload_bytes: int):
        self.sessions = [list(s) for s in sessions]
        self.read_bytes = align_up(file_bytes)  # one O_DIRECT read per file, to its aligned end
        self.file_bytes = file_bytes
        self.payload_bytes = payload_bytes  # counted per object, as kvtier's loads count them
        most = max(len(s) for s in self.sessions)
        self._ctx = aio.AioContext(max(most, 1))
        self._bufs = [alloc(self.read_bytes, populate=True, huge=True, whole=True) for _ in range(most)]

    def run(self) -> LoadPass:
        """Every session once, one after the other: payload bytes, wall
        seconds and this process's CPU seconds. Raises StorageBenchError if
        a file does not open with O_DIRECT or a read fails or comes back
        short (the figure would not be the device's)."""
        nbytes = 0
        c0, t0 = cpu_seconds(), time.perf_counter()
        for paths in self.sessions:
            fds: list[int] = []
            try:
                for p in paths:
                    fds.append(os.open(p, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0)))
                reqs = [(i, fd, address(self._bufs[i]), self.read_bytes, 0) for i, fd in enumerate(fds)]
                if self._ctx.submit(reqs) != len(reqs):
                    raise StorageBenchError("the kernel took fewer reads than a session's objects at once")
                left = len(reqs)
                while left:
                    for i, res in self._ctx.reap(1, None):
                        left -= 1
                        if res != self.file_bytes:
                            what = os.strerror(-res) if res < 0 else f"{res} of {self.file_bytes} bytes"
                            raise StorageBenchError(f"a burst read of {paths[i]} failed: {what}")
            except OSError as exc:
                raise StorageBenchError(f"a burst read could not open or submit: {exc}") from None
            finally:
                self._ctx.drain()  # no read is left in flight into a buffer or from a file closed here
                for fd in fds:
                    os.close(fd)
            nbytes += len(paths) * self.payload_bytes
        return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)

    def close(self) -> None:
        self._ctx.close()
