"""A bounded, prioritised thread pool and a byte-budgeted window of work.

One ``PriorityExecutor`` belongs to one tier. Jobs run in priority order
(LOAD before DELETE before STORE, FIFO within a priority) so that a burst of
write-through never delays a read. Threads start on the first submit, never in
a constructor, and are re-created after ``fork`` (the child gets none).

Where the threads run: a thread inherits the CPU affinity of the thread that
starts it, and an engine may pin its own threads for compute (vLLM's CPU
backend binds each worker's OpenMP threads, its main thread included, to
their cores: kvtier's threads started there would share the engine's cores,
docs/tuning.md). ``place_io_threads`` names the CPUs kvtier's threads use in this
process: the threads running now move there, and every thread started later
starts there. Placement is per process, as affinity is; its one writer is
the engine integration, at start-up.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

LOAD, DELETE, STORE, MAINTENANCE = 0, 1, 2, 3
JOB_KINDS = ("load", "delete", "store", "maintenance")  # by priority: what ``on_cpu`` calls a job

_placement_lock = threading.Lock()
_io_cpus: frozenset[int] | None = None  # None: threads keep the affinity they inherit
_live: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # kvtier threads of this process


def place_io_threads(cpus: Iterable[int] | None) -> None:
    """Run kvtier's executor threads of this process on ``cpus`` (None:
    inherit), those running now included. Linux only; elsewhere a no-op."""
    global _io_cpus
    if not hasattr(os, "sched_setaffinity"):
        return
    with _placement_lock:
        _io_cpus = None if cpus is None else frozenset(cpus)
        threads = list(_live)
    if _io_cpus is None:
        return
    for t in threads:
        if t.native_id is not None and t.is_alive():
            try:
                os.sched_setaffinity(t.native_id, _io_cpus)
            except OSError:  # the thread ended meanwhile
                pass


_AFFINITY_TTL_S = 1.0
_affinity: tuple[float, int] | None = None  # (when read, CPUs): the process's affinity, read at most once a second


def usable_cpus() -> int:
    """How many CPUs kvtier's threads of this process may run on: the
    placement's, else the process's affinity (a container's cpuset; read
    again after a second: every load asks, and the system call was the
    largest Python-side cost of a 2k load in a py-spy profile), else the
    machine's count."""
    global _affinity
    with _placement_lock:
        cpus = _io_cpus
    if cpus is not None:
        return max(1, len(cpus))
    now, seen = time.monotonic(), _affinity
    if seen is not None and now - seen[0] < _AFFINITY_TTL_S:
        return seen[1]
    try:
        n = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        n = max(1, os.cpu_count() or 1)
    _affinity = (now, n)
    return n


def _start_placed() -> None:
    """At the start of an executor thread: go where the placement says."""
    with _placement_lock:
        _live.add(threading.current_thread())
        cpus = _io_cpus
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        except OSError as exc:  # e.g. CPUs taken away by a cgroup since: run where inherited
            log.warning("kvtier: cannot run a thread on CPUs %s: %s", sorted(cpus), exc)


class PriorityExecutor:
    def __init__(self, name: str, workers: int, on_cpu: Callable[[str, float], None] | None = None):
        """``on_cpu(kind, seconds)``, if given, is told after each job its
        kind (``JOB_KINDS``, by priority) and the CPU its thread spent on it
        (the thread's own clock: reads, checksums and system calls, not
        time asleep)."""
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
        self._on_cpu = on_cpu

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

    def on_worker(self) -> bool:
        """Whether the calling thread is one of this executor's workers."""
        with self._lock:
            return threading.current_thread() in self._threads

    def _ensure_threads(self) -> None:
        # Called with the lock held.
        if self._pid != os.getpid():  # forked child: parent's threads do not exist here
            self._pid, self._threads, self._heap = os.getpid(), [], []
        while len(self._threads) < self.workers:
            t = threading.Thread(target=self._run, name=f"kvtier-{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self) -> None:
        _start_placed()
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                priority, _, fut, job = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.thread_time() if self._on_cpu is not None else 0.0
            try:
                result = job()
            except BaseException as exc:  # the future's owner reads and logs it
                self._spent(priority, t0)
                fut.set_exception(exc)
            else:
                # Counted before the future resolves: whoever waits on it
                # then sees the job's CPU in the metrics.
                self._spent(priority, t0)
                fut.set_result(result)

    def _spent(self, priority: int, t0: float) -> None:
        if self._on_cpu is None:
            return
        kind = JOB_KINDS[priority] if 0 <= priority < len(JOB_KINDS) else str(priority)
        try:
            self._on_cpu(kind, max(0.0, time.thread_time() - t0))
        except Exception:  # accounting never keeps a job's future from resolving
            log.exception("executor %s: counting a job's CPU failed", self.name)

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
