"""The native read loop with no store around it: ``kvtier bench storage``'s
"native read loop alone" line.

A directory tier's cold load runs the native read loop
(kvtier/_native/readloop.c: each object opened beneath the store's folder,
read with O_DIRECT through native AIO, its payload's XXH3-128 checked
against its header) inside the store: the load's plan, its read stream,
each object's bookkeeping (its header, its read latency, its recency stamp,
its lent buffer, its counters) and the hand-off of the loop to a pool
thread of the tier's executor. This runs the same loop, with the same
pacing (``nativestream.new_load``), over the same objects with none of
that: a thread waiting on a queue runs each session's loop, the caller
waits for each object as the loop settles it (the loop closes its file).

Its CPU per GB is the verified read itself: the kernel's part, the checksum
and the loop. What a cold load through the store spends above it is the
store's own bookkeeping, per load and per object, the part a leaner store
could still cut (docs/benchmarks.md). The store also checks each header
against the one it expects (a CRC-32 of 252 bytes per object); this does
not, which leaves it slightly cheaper per object.

Not a kvtier read path: nothing here serves data.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Sequence

from kvtier.bench.storage_common import LoadPass, StorageBenchError, cpu_seconds
from kvtier.buffers import alloc
from kvtier.tiers.dir import aio, beneath, nativestream

_WAIT_S = 60.0  # one object's longest wait: past it the run fails rather than hang


def why_not() -> str:
    """Why the loop cannot be timed here ("" if it can)."""
    if not nativestream.available():
        return "kvtier's native read loop is not built here"
    if not aio.available():
        return "native AIO is not available"
    if not beneath.available():
        return "the kernel has no openat2"
    return ""


class LoopAlone:
    """Loads sessions of objects (``sessions``: their paths below
    ``folder``, as a directory tier names them) with the native read loop
    alone, each object ``object_bytes`` long with ``payload_bytes`` of
    payload. Holds a buffer per object of the largest session, an AIO
    context and a thread (``close``)."""

    def __init__(self, folder: Path, sessions: Sequence[Sequence[bytes]], object_bytes: int, payload_bytes: int):
        why = why_not()  # also readies the loop (its checksum)
        if why:
            raise StorageBenchError(f"the native read loop cannot be timed here: {why}")
        self.folder = folder
        self.sessions = [list(s) for s in sessions]
        self.object_bytes, self.payload_bytes = object_bytes, payload_bytes
        most = max((len(s) for s in self.sessions), default=0)
        # On huge pages where the kernel has them, as the tier's read buffers are.
        self._bufs = [alloc(object_bytes, populate=True, huge=True, whole=True) for _ in range(most)]
        self._contexts = aio.ContextPool(keep=1)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ended: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kvtier-bench-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            load, fd = job
            try:
                load.run(fd)
                self._ended.put(None)
            except BaseException as exc:  # the caller raises it
                self._ended.put(exc)

    def run(self, window_bytes: int) -> LoadPass:
        """Every session once, one after the other, at most ``window_bytes``
        in flight: payload bytes, wall seconds and this process's CPU
        seconds. Raises StorageBenchError if an object does not come back
        read and verified (the figure would not be the loop's)."""
        nbytes = 0
        c0, t0 = cpu_seconds(), time.perf_counter()
        for paths in self.sessions:
            self._load(paths, window_bytes)
            nbytes += len(paths) * self.payload_bytes
        return LoadPass(nbytes, time.perf_counter() - t0, cpu_seconds() - c0)

    def _load(self, paths: list[bytes], window_bytes: int) -> None:
        """One session's load: its loop on the thread, its objects taken here in order."""
        try:
            base = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise StorageBenchError(f"could not open the store's folder {self.folder}: {exc}") from None
        ctx = self._contexts.take()
        load, started, taken = None, False, 0
        failed: str | None = None
        try:
            # Each verified object's file closed by the loop, as a tier's
            # load has it where the file owes no recency stamp
            # (``FileTier._stamped_since``).
            load = nativestream.new_load(paths, [self.object_bytes] * len(paths), ctx, window_bytes,
                                         close_fresh=-math.inf)
            load.give(0, self._bufs[: len(paths)])
            self._jobs.put((load, base))
            started = True
            for p in paths:
                state = load.wait(taken, _WAIT_S)
                if state != nativestream._readloop.OK:
                    failed = f"{p.decode(errors='replace')} was not read and verified by the native loop (state {state})"
                    break
                taken += 1
        finally:
            if load is not None:
                load.stop(taken)
            error = self._ended.get() if started else None
            if load is not None:  # files the loop left open (objects it did not verify)
                for i in range(len(paths)):
                    fd = load.item(i)[2]
                    if fd >= 0:
                        os.close(fd)
            self._contexts.give(ctx)
            os.close(base)
        if error is not None:
            raise StorageBenchError(f"the native read loop failed: {error}")
        if failed is not None:
            raise StorageBenchError(failed)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._contexts.close()
