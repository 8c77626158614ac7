"""``LoadStamps``: the recency stamps one load owes, made once its consumer
is done with the load, not between a read and its hand-over.

Why: the shared tier's recency is each object's mtime, stamped when a read
finds it older than ``touch_interval_s`` (``ObjectDir.stamp``): on a cold
resume, every object the load reads. A stamp is one ``futimens``, but on a
network or FUSE file system it is a round trip: made between each object's
verification and its hand-over, on the job that verifies the load's objects
one after the other, the stamps would delay every object the consumer
waits for (docs/benchmarks.md). Recency needs the stamp, not the consumer
waiting for it.

How: a read that owes a stamp hands its file, still open, to its load's
``LoadStamps`` (``add``) instead of closing it. Once the consumer is done
(``flush``, called by the stream's ``stop`` on the consumer's thread, which
must not wait on the mount), one job on the tier's pool stamps them all and
closes them. A read that lands after the flush (the consumer stopped while
it was being verified) stamps its own file at once: nobody waits for it.

``Owed`` counts, tier-wide, the stamps handed over and not made yet: the
collector settles them before it judges recency, so that an object read
just before a collection pass is never evicted because its stamp was still
on its way.

Threads: ``add`` from the threads that verify a load's reads, ``flush``
from its consumer's; both thread-safe.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


class Owed:
    """Stamps handed to a ``LoadStamps`` and not made yet, tier-wide."""

    __slots__ = ("_n", "_cv")

    def __init__(self) -> None:
        self._n = 0
        self._cv = threading.Condition()

    def add(self, n: int = 1) -> None:
        with self._cv:
            self._n += n

    def done(self, n: int = 1) -> None:
        with self._cv:
            self._n -= n
            if self._n <= 0:
                self._cv.notify_all()

    def settle(self, timeout_s: float) -> bool:
        """Wait until every stamp owed now or later is made, at most
        ``timeout_s``; whether none is left."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._n > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True


class LoadStamps:
    """The stamps one load owes, made by one job once its consumer is done.

    ``run_later(fn)`` runs ``fn`` on the tier's pool (raises RuntimeError
    when the tier is closing: the files are then closed unstamped; recency
    is a hint, never worth a wait)."""

    __slots__ = ("_run_later", "_owed", "_lock", "_fds", "_flushed")

    def __init__(self, run_later: Callable[[Callable[[], None]], object], owed: Owed):
        self._run_later = run_later
        self._owed = owed
        self._lock = threading.Lock()
        self._fds: list[int] = []
        self._flushed = False

    def add(self, fd: int) -> None:
        """Owe a stamp through ``fd``, an object's file a read has open;
        this takes it (and closes it once stamped)."""
        self._owed.add()
        with self._lock:
            if not self._flushed:
                self._fds.append(fd)
                return
        _stamp_all([fd], self._owed)

    def flush(self) -> None:
        """The consumer is done: stamp what is owed, on the pool (once;
        later calls do nothing)."""
        with self._lock:
            if self._flushed:
                return
            self._flushed = True
            fds, self._fds = self._fds, []
        if not fds:
            return
        try:
            self._run_later(lambda: _stamp_all(fds, self._owed))
        except RuntimeError:  # the tier is closing
            for fd in fds:
                os.close(fd)
            self._owed.done(len(fds))


def _stamp_all(fds: list[int], owed: Owed) -> None:
    """Stamp each file's mtime now and close it (an object deleted or
    replaced meanwhile: its old file is stamped, harmlessly)."""
    try:
        for fd in fds:
            now = time.time()
            try:
                os.utime(fd, (now, now))
            except OSError:
                pass
            try:
                os.close(fd)
            except OSError:
                pass
    finally:
        owed.done(len(fds))
