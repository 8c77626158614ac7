"""A worker's asynchronous loads in flight, from the claim to the report.

Each load (``Flight``) is read on the worker's loader pool, which hands its
chunks over as they arrive; the engine thread copies them into the engine's
blocks at every ``get_finished``. ``Flights`` keeps the loads that were
started and not yet reported, and what was read of each:

- The loader's time is shared between the loads reading at once: each
  load's share of the reading time is the time that was its own, which
  the scheduler's cost model turns into the tier's one-load-alone rate
  (costs.py), so the loader's concurrency is counted once.
- A load the scheduler gave a budget (``LoadJob.budget_s``) stops reading
  once its reads have run that long (checked by the engine thread), or as
  soon as the chunks that arrived show its remainder would take longer to
  read than to recompute (checked by the loader at each arrival). It keeps
  the chunks that arrived and the rest is reported failed, as a timeout is.

Threads: ``Flights``' lock guards what the loader and the engine thread
share (arrivals, reading state, stops); ``Flight.copied`` and its device
copies are the engine thread's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch

from kvtier.codec import ChunkObject
from kvtier.integrations.vllm.layout import PageLayout
from kvtier.integrations.vllm.metadata import LoadJob

log = logging.getLogger(__name__)

# A load is stopped early only when the chunks that arrived read this many
# times slower than the engine computes (``Flight.projected_late``).
_PROJECTED_MARGIN = 2.0


class Flight:
    """One asynchronous load: chunks arrive from the loader thread in order
    (``arrived``, guarded by ``Flights``' lock) and are copied in by the
    engine thread (``copied``, engine thread only). Synchronous loads copy
    through one too, at once."""

    def __init__(self, job: LoadJob):
        self.job = job
        self.arrived: list[ChunkObject] = []
        self.read_done = False  # set by the loader's end, or by a stop at the budget
        self.reading_since: float | None = None  # perf_counter when its reads started (loader thread)
        self.share = 0.0  # seconds of reading that were its own (``Flights._share``; lock)
        self.received = 0  # leading chunks handed over by the loader (lock)
        self.stopped = ""  # why it was stopped early: "budget" or "projected" (lock)
        self.copied = 0  # leading chunks copied into the engine
        self.broken = False  # a copy failed: nothing more is copied
        self.pending: list = []  # device copies enqueued, not yet known complete

    def copy_in(self, layout: PageLayout, device, objs: list[ChunkObject]) -> None:
        """Copy ``objs``, the next chunks of the load, into their blocks
        (``device``: a ``DevicePath`` for device tensors, else None), and
        release them."""
        try:
            for obj in objs:
                if self.broken:
                    break
                c = self.job.chunks[self.copied]
                try:
                    if device is not None:
                        self.pending.append(device.load(c.block_ids, obj.payload, obj.header.shape, c.skip))
                    else:
                        src = torch.frombuffer(obj.payload, dtype=layout.dtype).view(obj.header.shape)
                        layout.scatter(c.block_ids, layout.leading_blocks(src, len(c.block_ids)), first=c.skip)
                    self.copied += 1
                except Exception as exc:
                    log.warning("kvtier: copying %s into the engine failed: %s; recomputing", self.job.req_id, exc)
                    self.broken = True
        finally:
            for o in objs:
                o.release()

    def copies_done(self, device) -> bool:
        """Whether every device copy of this load completed (their staging
        goes back to the pool); always true on CPU, where copies are done
        when ``copy_in`` returns."""
        while self.pending and self.pending[0].finished():
            device.release(self.pending.pop(0))
        return not self.pending

    def projected_late(self, now: float, block_size: int) -> bool:
        """Will the rest of this load, read at the pace of the chunks that
        arrived so far, take far longer than recomputing the rest? Judged
        from two chunks at least, and only at ``_PROJECTED_MARGIN`` x
        prefill's pace: on a host whose cores the engine keeps busy, the
        loader thread itself can be held up for a step, and one late chunk
        must not cost a long load (the budget still bounds it)."""
        prefill = self.job.prefill_s_per_token
        if prefill is None or self.reading_since is None or self.received < 2:
            return False
        got = _tokens(self.job.chunks[:self.received], block_size)
        left = _tokens(self.job.chunks[self.received:], block_size)
        if got <= 0 or left <= 0:
            return False
        return (now - self.reading_since) / got > _PROJECTED_MARGIN * prefill

    def loaded_tokens(self, block_size: int) -> int:
        """Tokens this load brought into the engine (chunks copied in)."""
        return _tokens(self.job.chunks[:self.copied], block_size)

    def missing_blocks(self) -> set[int]:
        """Blocks of the chunks that were not copied in (vLLM recomputes them)."""
        return {b for c in self.job.chunks[self.copied:] for b in c.block_ids[c.skip:]}


class Flights:
    """The asynchronous loads a worker started and has not reported, in
    the order they were started."""

    def __init__(self, block_size: int, busy_seconds):
        """``busy_seconds``: the counter of the time loads were queued or
        reading (``kvtier_vllm_load_busy_seconds_total``)."""
        self.block_size = block_size
        self._busy_seconds = busy_seconds
        self._lock = threading.Lock()
        self._inflight: dict[str, Flight] = {}
        # Loads reading now, and when their shares of the reading time were
        # last counted (lock): see ``_share``.
        self._reading: list[Flight] = []
        self._shared_at = 0.0
        self._arrived = threading.Event()  # set when a chunk arrived or a load finished reading
        self._busy_since: float | None = None  # while asynchronous loads are queued or reading (lock)

    def start(self, job: LoadJob) -> Flight | None:
        """A new flight for ``job`` (engine thread); None if one is already
        in flight for its request."""
        with self._lock:
            if job.req_id in self._inflight:
                return None
            flight = self._inflight[job.req_id] = Flight(job)
            if self._busy_since is None:
                self._busy_since = time.perf_counter()
        return flight

    def reading(self, flight: Flight, now: float) -> None:
        """``flight``'s reads start (loader thread)."""
        with self._lock:
            self._share(now)
            flight.reading_since = now
            self._reading.append(flight)

    def hand_over(self, flight: Flight, obj: ChunkObject) -> bool:
        """The loader read ``obj``, the next chunk of ``flight``: for the
        engine thread to copy in. False: read no more, the load was stopped
        (at its budget: ``obj`` is dropped; or now, its remainder projected
        late: ``obj`` is the last one handed over)."""
        with self._lock:
            if flight.read_done:  # stopped at its budget: what comes now is not copied in
                obj.release()
                return False
            flight.arrived.append(obj)
            flight.received += 1
            late = flight.projected_late(time.perf_counter(), self.block_size)
            if late:
                flight.stopped = "projected"
        self._arrived.set()
        return not late

    def read_ended(self, flight: Flight) -> None:
        """The loader is done with ``flight`` (loader thread): whatever did
        not arrive by now is not loaded."""
        with self._lock:
            if not flight.read_done:
                self._reads_ended(flight, time.perf_counter())
        self._arrived.set()

    def arrivals(self, idle: bool, wait_s: float) -> list[tuple[Flight, list[ChunkObject], bool]]:
        """Each flight with chunks that arrived since the last call or whose
        reading ended: (flight, those chunks, whether its reading ended)
        (engine thread). Loads past their budget are stopped first.
        ``idle``: the engine computes nothing this step, so wait up to
        ``wait_s`` (GIL released) for a chunk to arrive."""
        with self._lock:
            self._stop_overdue(time.perf_counter())
            waiting = idle and bool(self._inflight) and not any(
                f.arrived or f.read_done for f in self._inflight.values())
            self._arrived.clear()
        if waiting:
            self._arrived.wait(wait_s)
        with self._lock:
            self._stop_overdue(time.perf_counter())
            batches = [(f, f.arrived, f.read_done) for f in self._inflight.values() if f.arrived or f.read_done]
            for f, _, _ in batches:
                f.arrived = []
        return batches

    def in_order(self, done: list[Flight], release: int) -> list[Flight]:
        """Of the flights ``done``, those to report now: at most ``release``
        (0: all), in the order they were started, a finished one waiting
        behind an older one that is not (every rank then hands vLLM the
        same requests, whatever order its own reads ended in)."""
        if not release:
            return done
        ready = {id(f) for f in done}
        return list(itertools.takewhile(lambda f: id(f) in ready, self._inflight.values()))[:release]

    def reported(self, req_ids: set[str]) -> None:
        """These requests' loads were reported to vLLM (engine thread)."""
        with self._lock:
            for rid in req_ids:
                del self._inflight[rid]

    def _share(self, now: float) -> None:
        """Charge the time since the last count to the loads reading, each
        its 1/n share (lock held)."""
        if self._reading:
            part = (now - self._shared_at) / len(self._reading)
            for f in self._reading:
                f.share += part
        self._shared_at = now

    def _reads_ended(self, flight: Flight, now: float) -> None:
        """``flight`` is done reading, at its end or stopped (lock held);
        the loader's busy time ends with the last load in flight."""
        if flight in self._reading:
            self._share(now)
            self._reading.remove(flight)
        flight.read_done = True
        if self._busy_since is not None and all(f.read_done for f in self._inflight.values()):
            self._busy_seconds.inc(now - self._busy_since)
            self._busy_since = None

    def _stop_overdue(self, now: float) -> None:
        """Stop the loads whose reads ran past their budget (lock held): they
        end with what arrived, the rest is recomputed."""
        for f in self._inflight.values():
            budget = f.job.budget_s
            if f.read_done or f.reading_since is None or budget is None or now - f.reading_since < budget:
                continue
            log.debug("kvtier: load for %s stopped at its budget of %.1f ms", f.job.req_id, budget * 1e3)
            f.stopped = "budget"
            self._reads_ended(f, now)


def _tokens(chunks, block_size: int) -> int:
    """Tokens a load writes into the engine for ``chunks``."""
    return sum(len(c.block_ids) - c.skip for c in chunks) * block_size
