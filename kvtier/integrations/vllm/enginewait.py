"""The engine core's wait for its workers while kvtier loads.

When vLLM runs its workers in processes of their own (its default mode, and
every tensor-parallel engine), the engine core waits for each step's reply on
a shared-memory queue, and for a second after every reply it waits by
spinning: ``SpinCondition.wait`` calls ``sched_yield`` in a loop (vLLM
0.32-0.33, ``shm_broadcast.py``, ``busy_loop_s=1``, no setting). That keeps
one core busy for the whole step. A step that loads a session from storage
needs cores beside the model's own threads: reading, verifying and copying
in. On a host with few cores per engine the spin takes one of them, and a
cold 8k resume's reads took 163 against 102 ms (docs/benchmarks.md; with the
spin off, 96 against 96 ms).

So while a load of this engine is in flight, the engine core waits the way
vLLM itself waits when idle: blocked on the queue's notification socket,
which the writer signals after every message, and at least every 2 ms (a
notification can be lost, and vLLM's own recheck comes only after 5 s).
That costs a few hundred wake-ups a second, and only during loads (beside
a 2-thread matrix product: no measurable cost; beside vLLM's spin: +40 %); vLLM's
spin resumes after the load's step. ``spin_during_loads: true`` leaves vLLM's wait alone.

The change is one wrapper around ``SpinCondition.wait`` in the engine core's
process, installed at the first load by a scheduler-side connector that
wants it; a process without vLLM's queues (one process, TP=1), or a vLLM
without that class, is left alone.
"""

from __future__ import annotations

import logging
import sys
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loading = 0  # schedulers of this process with a load in flight
_installed: bool | None = None  # None: not tried yet
# The longest the engine core sleeps between looks at its queue during a
# load: a notification lost between writer and reader costs this, not vLLM's
# 5 s recheck interval (seen: 4 of 24 resumes 5 s late without the bound).
POLL_MS = 2


def _install() -> bool:
    """Wrap vLLM's ``SpinCondition.wait`` once per process, if this process
    uses vLLM's shared-memory queues at all (the executor imports them
    before the scheduler exists; an engine without them has nothing to do)."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        module = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
        if module is None:
            return False  # no queue in this process (yet): ask again at the next load
        spin_wait = getattr(getattr(module, "SpinCondition", None), "wait", None)
        if spin_wait is None:
            log.info("kvtier: this vLLM has no SpinCondition.wait; the engine core's wait is left as it is")
            _installed = False
            return False

        def wait(self, timeout_ms=None):
            if _loading and getattr(self, "is_reader", False):
                # vLLM's idle mode: block on the writer's notification
                # (record_read() after the next message restores the spin),
                # for at most POLL_MS: a notification can be lost, and vLLM's
                # own recheck comes only after 5 s.
                self.last_read = float("-inf")
                timeout_ms = POLL_MS if timeout_ms is None else min(timeout_ms, POLL_MS)
            return spin_wait(self, timeout_ms)

        wait.__doc__ = spin_wait.__doc__
        wait.__wrapped__ = spin_wait
        module.SpinCondition.wait = wait
        _installed = True
        log.info("kvtier: while kvtier loads, this engine core waits for its workers without spinning "
                 "(spin_during_loads: true turns this off)")
        return True


class QuietWhileLoading:
    """One scheduler's say in the engine core's wait: ``loading(True)``
    when it hands out a load, ``loading(False)`` once none is in flight."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._on = False

    def loading(self, busy: bool) -> None:
        global _loading
        if not self.enabled or busy == self._on or (busy and not _install()):
            return
        self._on = busy
        with _lock:
            _loading += 1 if busy else -1

    def close(self) -> None:
        self.loading(False)
