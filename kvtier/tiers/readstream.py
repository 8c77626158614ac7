"""``ReadStream``: the byte-windowed parallel reader of the tiers that read
one object per call (``PooledTier``: directory, Redis, S3).

Threads: the stream's reads run on the tier's ``PriorityExecutor``; the
consumer's thread iterates; completion callbacks (on the pool's workers)
submit the next reads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable, Iterator, Sequence

from kvtier.codec import ChunkObject
from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier.keys import ChunkKey

# Reads in flight whatever the window: with one, the device idles while each
# object is verified and the next read submitted, and objects larger than half
# the window (a 7B model's 14 MiB chunk under a 16 MiB window) are read one at
# a time (measured in docs/benchmarks.md).
MIN_INFLIGHT = 2


class ReadStream:
    """Reads ``keys`` in parallel within a byte budget and yields the verified
    objects in key order, stopping at the first miss.

    Reads go into buffers the stream allocates, never into the caller's, so a
    read that finishes after a timeout harms nobody. Completion callbacks
    start the next reads as budget frees up: no submitter thread, no rounds.
    ``read_one`` returns the object or None (miss) and may raise for errors.
    """

    def __init__(
        self,
        executor: PriorityExecutor,
        keys: Sequence[ChunkKey],
        read_one: Callable[[ChunkKey], ChunkObject | None],
        window_bytes: int,
        bytes_per_token: Callable[[], int],
        path: str = "",
        ended: Callable[[], None] = lambda: None,
        done: Callable[[], None] = lambda: None,
    ):
        self.path = path  # what the owner calls this way of reading (its accounting)
        self.delivers = False  # objects are handed over uncopied (``AioStream`` may copy them on its pool)
        self._executor = executor
        self._keys = keys
        self._read_one = read_one
        self._window = window_bytes
        self._bpt = bytes_per_token
        self._lock = threading.Condition()
        self._futs: list[Future | None] = [None] * len(keys)
        self._next = 0
        self._inflight = 0  # estimated bytes of the reads in flight
        self._reads = 0  # reads in flight
        self._stopped = False
        # Called once no read is in flight and none will start (stopped, or
        # every key submitted): what the reads shared, the owner may close.
        self._ended: Callable[[], None] | None = ended
        # Called once, by the first ``stop`` (the consumer is done, or never
        # started), on the stopping thread: it must not block.
        self._done_hook: Callable[[], None] | None = done
        self.failed: BaseException | None = None  # error or timeout that ended the stream
        with self._lock:
            self._fill()

    def _fill(self) -> None:
        # Lock held. Submit reads while the window has room (MIN_INFLIGHT always fit).
        while not self._stopped and self._next < len(self._keys):
            key = self._keys[self._next]
            est = max(1, key.num_tokens * self._bpt())
            if self._reads >= MIN_INFLIGHT and self._inflight + est > self._window:
                return
            fut = self._executor.submit(LOAD, self._read_one, key)
            self._futs[self._next] = fut
            self._next += 1
            self._inflight += est
            self._reads += 1
            fut.add_done_callback(lambda _f, est=est: self._done(est))
            self._lock.notify_all()

    def _done(self, est: int) -> None:
        with self._lock:
            self._inflight -= est
            self._reads -= 1
            self._fill()
            ended = self._take_ended()
        if ended is not None:
            ended()

    def _take_ended(self) -> Callable[[], None] | None:
        # Lock held. The ``ended`` hook, once, when it is due.
        if self._ended is None or self._reads or not (self._stopped or self._next >= len(self._keys)):
            return None
        ended, self._ended = self._ended, None
        return ended

    def stop(self, consumed: int = 0) -> None:
        """Stop submitting; cancel queued reads; release objects read but not
        handed out (reads still running release theirs when they finish).
        The first call runs the ``done`` hook."""
        with self._lock:
            self._stopped = True
            futs = [f for f in self._futs[consumed:] if f is not None]
            done, self._done_hook = self._done_hook, None
        for f in futs:
            if not f.cancel():
                f.add_done_callback(_release_result)
        with self._lock:
            ended = self._take_ended()
        if ended is not None:
            ended()
        if done is not None:
            done()

    def iter(self, timeout: float | None) -> Iterator[ChunkObject]:
        """Yield objects in key order. Each yielded object is handed over with
        its reference: the consumer releases it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handed = 0  # results [0, handed) belong to the consumer
        try:
            for i in range(len(self._keys)):
                with self._lock:
                    while self._futs[i] is None and not self._stopped:
                        self._lock.wait(0.05)
                    fut = self._futs[i]
                if fut is None:
                    return
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    obj = fut.result(remaining)
                except FutureTimeout as exc:
                    self.failed = exc
                    return
                except Exception as exc:  # I/O error: logged by the tier
                    self.failed = exc
                    return
                if obj is None:
                    return
                handed = i + 1
                yield obj
        finally:
            self.stop(consumed=handed)


def _release_result(fut: Future) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    obj = fut.result()
    if obj is not None:
        obj.release()
