"""``ReadPathChooser``: which way a directory tier reads each load, O_DIRECT
(as configured: native AIO or a thread per read) or buffered with readahead,
chosen from the rates its own recent loads reached.

Why: which path is faster depends on the storage, and on some it changes
from one minute to the next (docs/benchmarks.md); an operator cannot tune
for a device like that, and a default must hold on storage it was never
measured on. So the tier measures
instead: every load's bytes over its seconds, per path, in a moving
average; each load takes the path with the higher average, and every
``explore_every``-th load takes the other one, so that a change of regime
is noticed within a few dozen loads. What the exploration costs: at most
one load in ``explore_every`` on the slower path. Buffered reads are taken
only when they read ``margin`` times faster: they cost more CPU per byte
(the page cache's copy), and one load's rate is noisy, so near-equal paths
must not flap.

A load's rate includes the time its consumer took between objects (the copy
into the engine's blocks), the same for both paths. Loads smaller than
``min_bytes`` are not counted: their time is latency, not bandwidth; nor is
each path's first load (``warmup``), which pays for what later loads reuse
(fresh buffers faulted in, an AIO context, cold metadata), so that the path
measured first is not judged by its set-up.

Threads: ``pick`` and ``record`` are called from any thread (one lock).
"""

from __future__ import annotations

import threading

DIRECT, BUFFERED = "direct", "buffered"
PATHS = (DIRECT, BUFFERED)


class ReadPathChooser:
    def __init__(self, explore_every: int = 16, weight: float = 0.3, min_bytes: int = 8 << 20, margin: float = 1.15,
                 warmup: int = 1):
        if explore_every < 2:
            raise ValueError("explore_every must be at least 2")
        self.explore_every = explore_every
        self.weight = weight
        self.min_bytes = min_bytes
        self.margin = margin
        self._warmup = {p: warmup for p in PATHS}  # loads of each path still to leave uncounted
        self._lock = threading.Lock()
        self._rate: dict[str, float | None] = {p: None for p in PATHS}  # bytes/s, moving average
        self._picks = 0

    def pick(self) -> str:
        """The path for the next load: one not measured yet, else the faster
        (buffered by ``margin``), except every ``explore_every``-th load,
        which takes the other."""
        with self._lock:
            self._picks += 1
            for p in PATHS:
                if self._rate[p] is None:
                    return p
            direct, buffered = self._rate[DIRECT], self._rate[BUFFERED]
            best = BUFFERED if buffered > self.margin * direct else DIRECT  # type: ignore[operator]
            if self._picks % self.explore_every == 0:
                return BUFFERED if best == DIRECT else DIRECT
            return best

    def record(self, path: str, nbytes: int, seconds: float) -> float | None:
        """A load on ``path`` read ``nbytes`` in ``seconds``; the path's
        moving average after it (None when the load was too small to count)."""
        if nbytes < self.min_bytes or seconds <= 0:
            return None
        rate = nbytes / seconds
        with self._lock:
            if self._warmup[path] > 0:
                self._warmup[path] -= 1
                return None
            old = self._rate[path]
            new = rate if old is None else old + self.weight * (rate - old)
            self._rate[path] = new
            return new

    def rates(self) -> dict[str, float | None]:
        """Each path's moving average in bytes/s (None: not measured yet)."""
        with self._lock:
            return dict(self._rate)
