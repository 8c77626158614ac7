"""Worker side: moves bytes between vLLM's KV cache and kvtier. Decides nothing.

It orchestrates: ``ShardReader`` reads this rank's shard of each chunk
(reader.py), ``Flights`` follows the asynchronous loads until they are
reported (flight.py), ``Saver`` writes the chunks a step completed
(saves.py), and ``DevicePath`` copies to and from device tensors
(transfer.py).

Threads:
- vLLM's worker thread calls every public method.
- Loads run on this object's ``_loader`` pool: the blocks they write belong
  to requests vLLM holds back (WAITING_FOR_REMOTE_KVS) until ``get_finished``
  reports them, so nothing else touches those blocks meanwhile. Every load
  that was started is reported, failed or not: vLLM keeps the blocks until
  then, even for a request aborted meanwhile. A load stopped early (its
  budget, or its remainder projected late: flight.py) keeps the chunks that
  arrived; a read under way when it stops ends in the background and its
  object is dropped.
- Saves run in the worker thread in ``wait_for_save``, after the forward pass,
  while the blocks are certainly valid.

Keys: the scheduler sends the TP group's chunk keys; this worker reads and
writes only its own shard of each, under the shard's key (``Topology``).
Under tensor parallelism every rank reports its own failed blocks, and vLLM
recomputes the union for all ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from kvtier.concurrency.executor import LOAD, PriorityExecutor, place_io_threads
from kvtier.engine.store import TieredStore
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.events import RankEvents
from kvtier.integrations.vllm.flight import Flight, Flights
from kvtier.integrations.vllm.iocpus import cpu_list, io_thread_cpus
from kvtier.integrations.vllm.layout import PageLayout, detect
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadJob
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.reader import ShardReader
from kvtier.integrations.vllm.saves import Saver
from kvtier.integrations.vllm.settings import Settings

log = logging.getLogger(__name__)

# On a step that computes nothing, wait this long at most for a load to
# finish reading. Spinning through empty steps instead holds the GIL, and
# every hand-off between kvtier's I/O threads then waits out Python's switch
# interval (5 ms): that cost ~15 ms per resumed request before this wait.
_IDLE_WAIT_S = 0.005


class KVTierWorker:
    def __init__(self, settings: Settings, store: TieredStore, layer_names: list[str], num_blocks: int,
                 metrics: ConnectorMetrics, events: RankEvents | None = None):
        """``events``: with vLLM's KV events on, what this rank's store hears
        (events.py), sent with each step's worker metadata."""
        self.settings = settings
        self.events = events
        if events is not None:
            store.listen(events)
        self.store = store
        self.metrics = metrics
        self.topology = settings.topology
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.layout: PageLayout | None = None
        self.device = None  # DevicePath for device tensors (transfer.py); CPU pages are copied directly
        self.reader: ShardReader | None = None  # once the KV caches are registered
        self.saver: Saver | None = None  # likewise
        self._sync_pending: list = []  # device copies of synchronous loads, staging not yet back
        self.page = ""  # backend and page layout, for the scheduler side (handshake)
        self._loader = PriorityExecutor("vllm-load", settings.load_threads)
        self._flights = Flights(settings.block_size, metrics.load_busy_seconds)
        self._lock = threading.Lock()
        self._errors_to_report: set[int] = set()  # (lock)
        self._reads: dict[str, tuple[float, int]] = {}  # finished loads (seconds, tokens), not yet reported (engine thread)
        self._stopped: dict[str, str] = {}  # of those, the loads stopped early: why (engine thread)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str = "unknown") -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError("kv_caches", f"no KV cache tensor for layer {missing[0]}", "report this vLLM version")
        layers = [kv_caches[n] for n in self.layer_names]
        self.layout = detect(layers, self.num_blocks, expected=self.settings.kv_layout)
        self.page = f"{backend}/{self.layout.describe()}"
        self._place_threads()
        if self.layout.device.type != "cpu":
            from kvtier.integrations.vllm.transfer import DevicePath

            self.device = DevicePath(self.layout)
        self.reader = ShardReader(self.settings, self.store, self.layout, self.metrics)
        self.saver = Saver(self.store, self.layout, self.settings.kv_dtype, self.reader.key, self.metrics, self.device)
        dtype = str(self.layout.dtype).removeprefix("torch.")
        if dtype != self.settings.kv_dtype:
            raise ConfigError("kv_cache_dtype", f"KV tensors are {dtype}, the spec says {self.settings.kv_dtype}", "report this vLLM version")
        log.info("kvtier: %d layers, pages %s, chunk shape %s", len(layers), self.page,
                 self.layout.chunk_shape(self.settings.store.chunk_tokens // self.settings.block_size))

    def _place_threads(self) -> None:
        """Move kvtier's threads of this process off the engine's compute
        pin (``io_cpus``): on vLLM's CPU backend in multiprocess mode every
        worker thread is pinned to its OpenMP core, and cold reads ran on that
        one core at half the speed they reach in one process (measured,
        docs/benchmarks.md)."""
        cpus = io_thread_cpus(self.settings.io_cpus, self.layout.device.type == "cpu")
        if cpus is None:
            return
        inherited = os.sched_getaffinity(0)
        place_io_threads(cpus)
        if set(cpus) != inherited:
            log.info("kvtier: I/O threads run on CPUs %s (this worker's thread is pinned to %s)",
                     cpu_list(cpus), cpu_list(inherited))

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Synchronous loads (chunks in host memory) are copied in right here,
        before this step's forward (on a device: enqueued, the forward
        ordered after them); asynchronous ones go to the loader."""
        if self._sync_pending:
            self._sync_pending = [p for p in self._sync_pending if not self._reclaimed(p)]
        for job in meta.loads:
            self._name(job.chunks)
            if job.sync:
                t0 = time.perf_counter()
                try:
                    objs = self.reader.read(job)
                except Exception as exc:  # a failed load is a recompute, never a failed request
                    log.warning("kvtier: load for %s failed: %s; recomputing", job.req_id, exc)
                    objs = []
                flight = Flight(job)
                flight.copy_in(self.layout, self.device, objs)
                self._sync_pending.extend(flight.pending)
                failed = flight.missing_blocks()
                self.metrics.scatter_seconds.observe(time.perf_counter() - t0)
                with self._lock:
                    self._errors_to_report |= failed
                continue
            flight = self._flights.start(job)
            if flight is None:
                continue
            fut = self._loader.submit(LOAD, self._load, job, flight)
            fut.add_done_callback(lambda f, flight=flight: self._read_ended(flight, f))

    def _load(self, job: LoadJob, flight: Flight) -> None:
        """Read an asynchronous load (loader thread), handing each chunk to
        the engine thread as it arrives."""
        self._flights.reading(flight, time.perf_counter())
        self.reader.read(job, lambda obj: self._flights.hand_over(flight, obj))

    def _read_ended(self, flight: Flight, fut) -> None:
        """The loader is done with ``flight`` (loader thread)."""
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:  # a failed load is a recompute, never a failed request
            log.warning("kvtier: load for %s failed: %s; recomputing", flight.job.req_id, exc)
        self._flights.read_ended(flight)

    def get_finished(self, finished_req_ids: set[str], idle: bool = False,
                     release: int = 0) -> tuple[set[str] | None, set[str] | None]:
        """Copy the chunks that arrived since the last step into their engine
        blocks, here on the engine's thread (a few memcpys per chunk, which a
        loader thread would do far slower, waiting for the GIL between each),
        and report the loads whose reading ended and whose chunks are all in.

        ``idle``: this step computed nothing, so waiting here delays no other
        request; wait (GIL released) until a chunk arrives, at most
        ``_IDLE_WAIT_S``.

        ``release``: report at most this many loads (0: all), in the order
        they were started (``Flights.in_order``); the others are reported in
        later steps."""
        batches = self._flights.arrivals(idle, _IDLE_WAIT_S)
        if not batches:
            return None, None
        t0 = time.perf_counter()
        finished: set[str] = set()
        failed: set[int] = set()
        done = []
        for flight, objs, read_done in batches:
            flight.copy_in(self.layout, self.device, objs)
            # Everything that will arrive has, and is in the engine's blocks
            # (device copies completed): it may be reported.
            if read_done and flight.copies_done(self.device):
                done.append(flight)
        for flight in self._flights.in_order(done, release):
            failed |= flight.missing_blocks()
            finished.add(flight.job.req_id)
            self._reads[flight.job.req_id] = (flight.share, flight.loaded_tokens(self.settings.block_size))
            if flight.stopped:
                self._stopped[flight.job.req_id] = flight.stopped
        self.metrics.scatter_seconds.observe(time.perf_counter() - t0)
        self._flights.reported(finished)
        with self._lock:
            self._errors_to_report |= failed
        return None, finished or None

    def worker_meta(self, step: int = 0) -> KVTierWorkerMeta | None:
        """The read times of the loads reported finished since the last call
        (engine thread, once per step), with the number of the step: the
        scheduler's cost model learns each tier's speed and each step's
        time from them (costs.py). None only when there is neither."""
        events = self.events.take() if self.events is not None else []
        if not self._reads and not step and not events:
            return None
        meta, self._reads, self._stopped = KVTierWorkerMeta(self._reads, self._stopped, step, events), {}, {}
        return meta

    def _name(self, chunks) -> None:
        """Tell the events which shard names these group chunks have here
        (a shard of another TP size's chunk is not this engine's to publish)."""
        if self.events is None or self.reader is None:
            return
        for c in chunks:
            if not c.source_tp:
                self.events.name(c.key, self.reader.topology.shards(c.key))

    def _reclaimed(self, p) -> bool:
        if not p.finished():
            return False
        self.device.release(p)
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors_to_report = self._errors_to_report, set()
        return errors

    # ------------------------------------------------------------ saves
    def wait_for_save(self, meta: KVTierMetadata) -> None:
        if not meta.saves or not self.topology.saves:
            return
        t0 = time.perf_counter()
        for job in meta.saves:
            self._name(job.chunks)
            self.saver.save(job)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self._loader.close()
        self.store.close()
