"""A bounded, prioritised thread pool and a byte-budgeted window of work.

One ``PriorityExecutor`` belongs to one tier. Jobs run in priority order
(LOAD before DELETE before STORE, FIFO within a priority) so that a burst of
write-through never delays a read. Threads start on the first submit, never in
a constructor, and are re-created after ``fork`` (the child gets none).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

log = logging.getLogger(__name__)

LOAD, DELETE, STORE, MAINTENANCE = 0, 1, 2, 3


class PriorityExecutor:
    def __init__(self, name: str, workers: int):
        if workers <= 0:
            raise ValueError("workers must be positive")
        self.name = name
        self.workers = workers
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._heap: list[tuple[int, int, Future, Callable[[], Any]]] = []
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()
        self._closed = False

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(f"executor {self.name} is closed")
            self._ensure_threads()
            heapq.heappush(self._heap, (priority, next(self._seq), fut, lambda: fn(*args)))
            self._cv.notify()
        return fut

    def pending(self) -> int:
        with self._lock:
            return len(self._heap)

    def _ensure_threads(self) -> None:
        # Called with the lock held.
        if self._pid != os.getpid():  # forked child: parent's threads do not exist here
            self._pid, self._threads, self._heap = os.getpid(), [], []
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._run, name=f"kvtier-{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, fut, job = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as exc:  # the future's owner reads and logs it
                fut.set_exception(exc)

    def close(self, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop accepting work; run (or cancel) what is queued; join workers."""
        with self._cv:
            self._closed = True
            if cancel_pending:
                for _, _, fut, _ in self._heap:
                    fut.cancel()
                self._heap.clear()
            self._cv.notify_all()
            threads = list(self._threads) if self._pid == os.getpid() else []
        for t in threads:
            t.join(timeout)


class ByteWindow:
    """At most ``limit`` bytes of work in flight; a single oversized item may
    still go alone, so progress never stalls.

    ``acquire`` blocks the submitting thread; ``release`` is called from the
    completion callback of each job. There is no barrier between rounds: a new
    read starts as soon as any earlier one frees enough budget.
    """

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._inflight = 0
        self._cv = threading.Condition()

    def acquire(self, n: int, timeout: float | None = None) -> bool:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._inflight == 0 or self._inflight + n <= self.limit, timeout)
            if ok:
                self._inflight += n
            return ok

    def release(self, n: int) -> None:
        with self._cv:
            self._inflight -= n
            self._cv.notify_all()
