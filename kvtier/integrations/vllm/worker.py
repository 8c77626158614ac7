"""Worker side: moves bytes between vLLM's KV cache and kvtier. Decides nothing.

Threads:
- vLLM's worker thread calls every public method.
- Loads run on this object's ``_loader`` pool: the blocks they write belong
  to requests vLLM holds back (WAITING_FOR_REMOTE_KVS) until ``get_finished``
  reports them, so nothing else touches those blocks meanwhile. Every load
  that was started is reported, failed or not: vLLM keeps the blocks until
  then, even for a request aborted meanwhile.
- A load the scheduler gave a budget (``LoadJob.budget_s``) stops reading
  once its reads have run that long (checked by the engine thread at every
  ``get_finished``), or as soon as the chunks that arrived show its
  remainder would take longer to read than to recompute (checked by the
  loader at each arrival). It keeps the chunks that arrived and reports
  the rest failed, as a timeout does; a read under way when it stops ends
  in the background and its object is dropped.
- Saves run in the worker thread in ``wait_for_save``, after the forward pass,
  while the blocks are certainly valid: one copy of each block into a pooled
  chunk object; the store writes it through in the background.

Keys: the scheduler sends the TP group's chunk keys; this worker reads and
writes only its own shard of each, under the shard's key (``Topology``).
Under tensor parallelism every rank reports its own failed blocks, and vLLM
recomputes the union for all ranks.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import torch

from kvtier.codec import DTYPE_SIZES, ChunkObject, build, encode
from kvtier.concurrency.executor import LOAD, STORE, PriorityExecutor, place_io_threads
from kvtier.engine.store import TieredStore
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.layout import PageLayout, detect
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.settings import Settings, cpu_list, io_thread_cpus
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

# On a step that computes nothing, wait this long at most for a load to
# finish reading. Spinning through empty steps instead holds the GIL, and
# every hand-off between kvtier's I/O threads then waits out Python's switch
# interval (5 ms): that cost ~15 ms per resumed request before this wait.
_IDLE_WAIT_S = 0.005
# A load is stopped early only when the chunks that arrived read this many
# times slower than the engine computes (``_InFlight.projected_late``).
_PROJECTED_MARGIN = 2.0


class KVTierWorker:
    def __init__(self, settings: Settings, store: TieredStore, layer_names: list[str], num_blocks: int,
                 metrics: ConnectorMetrics):
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.topology = settings.topology
        self._shard = settings.topology.own_shard
        self.layer_names = layer_names
        self.num_blocks = num_blocks
        self.layout: PageLayout | None = None
        self.device = None  # DevicePath for device tensors (transfer.py); CPU pages are copied directly
        self._sync_pending: list = []  # device copies of synchronous loads, staging not yet back
        self._saver: PriorityExecutor | None = None
        self.page = ""  # backend and page layout, for the scheduler side (handshake)
        self._loader = PriorityExecutor("vllm-load", settings.load_threads)
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}  # asynchronous loads not yet reported
        self._errors_to_report: set[int] = set()
        self._reads: dict[str, tuple[float, int]] = {}  # finished loads (seconds, tokens), not yet reported (engine thread)
        self._stopped: dict[str, str] = {}  # of those, the loads stopped early: why (engine thread)
        # Loads reading now, and when their shares of the reading time were
        # last counted (guarded by the lock): see ``_share``.
        self._reading: list[_InFlight] = []
        self._shared_at = 0.0
        self._arrived = threading.Event()  # set when a chunk arrived or a load finished reading
        self._busy_since: float | None = None  # while asynchronous loads are queued or reading (under _lock)

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
            self._saver = PriorityExecutor("vllm-save", 1)
        dtype = str(self.layout.dtype).removeprefix("torch.")
        if dtype != self.settings.kv_dtype:
            raise ConfigError("kv_cache_dtype", f"KV tensors are {dtype}, the spec says {self.settings.kv_dtype}", "report this vLLM version")
        log.info("kvtier: %d layers, pages %s, chunk shape %s", len(layers), self.page,
                 self.layout.chunk_shape(self.settings.store.chunk_tokens // self.settings.block_size))

    def _key(self, key: ChunkKey) -> ChunkKey:
        """This rank's shard of the group's chunk ``key``."""
        return self.topology.shard(key, self._shard)

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: KVTierMetadata) -> None:
        """Synchronous loads (chunks in host memory) are copied in right here,
        before this step's forward (on a device: enqueued, the forward
        ordered after them); asynchronous ones go to the loader."""
        if self._sync_pending:
            self._sync_pending = [p for p in self._sync_pending if not self._reclaimed(p)]
        for job in meta.loads:
            if job.sync:
                t0 = time.perf_counter()
                try:
                    objs = self._load(job)
                except Exception as exc:  # a failed load is a recompute, never a failed request
                    log.warning("kvtier: load for %s failed: %s; recomputing", job.req_id, exc)
                    objs = []
                flight = _InFlight(job)
                flight.copy_in(self, objs)
                self._sync_pending.extend(flight.pending)
                failed = flight.missing_blocks()
                self.metrics.scatter_seconds.observe(time.perf_counter() - t0)
                with self._lock:
                    self._errors_to_report |= failed
                continue
            with self._lock:
                if job.req_id in self._inflight:
                    continue
                flight = self._inflight[job.req_id] = _InFlight(job)
                if self._busy_since is None:
                    self._busy_since = time.perf_counter()
            fut = self._loader.submit(LOAD, self._load, job, flight)
            fut.add_done_callback(lambda f, flight=flight: self._read_ended(flight, f))

    def _load(self, job: LoadJob, flight: _InFlight | None = None) -> list[ChunkObject]:
        """Read this rank's shard of the job's chunks (loader thread). Returns
        the leading chunks that verified and have the expected shape, each
        retained: they stay valid until they are copied into the engine. With
        ``flight`` (an asynchronous load) each chunk is handed over as it
        arrives, so that the engine thread copies the first chunks while
        later ones are read; nothing is returned then.

        A chunk held at another TP size (``source_tp``) is read as the
        shards of that size which hold this rank's heads, and this rank's
        shard is cut from them (``_assemble``); it is stored under this
        rank's own key too, so the next load reads it directly."""
        t0 = time.perf_counter()
        if flight is not None:
            with self._lock:
                self._share(t0)
                flight.reading_since = t0
                self._reading.append(flight)
        objs: list[ChunkObject] = []
        wanted = [self._sources(c) for c in job.chunks]
        try:
            it = self.store.fetch([k for ks in wanted for k in ks])
            try:
                complete = True
                for c, ks in zip(job.chunks, wanted):
                    got: list[ChunkObject] = []
                    for _ in ks:
                        obj = next(it, None)
                        if obj is None:
                            break
                        got.append(obj.retain())  # the fetch releases it when resumed
                    obj = self._chunk(c, got) if len(got) == len(ks) else None
                    for o in got:
                        o.release()
                    if obj is None:
                        complete = False
                        break
                    if flight is None:
                        objs.append(obj)
                        continue
                    with self._lock:
                        if flight.read_done:  # stopped at its budget: what comes now is not copied in
                            obj.release()
                            complete = False
                            break
                        flight.arrived.append(obj)
                        flight.received += 1
                        late = flight.projected_late(time.perf_counter(), self.settings.block_size)
                        if late:
                            flight.stopped = "projected"
                    self._arrived.set()
                    if late:
                        complete = False
                        break
                if complete:
                    # Resumed once more, the fetch promotes the last object
                    # into memory and ends.
                    next(it, None)
            finally:
                it.close()
        except BaseException:
            for o in objs:
                o.release()
            raise
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return objs

    def _sources(self, c) -> list[ChunkKey]:
        """The stored objects that make up this rank's shard of chunk ``c``."""
        if c.source_tp in (0, self.topology.tp_size):
            return [self._key(c.key)]
        return [self.topology.shard(c.key, s, c.source_tp) for s in self.topology.sources(self._shard, c.source_tp)]

    def _chunk(self, c, got: list[ChunkObject]) -> ChunkObject | None:
        """This rank's shard of ``c`` from the objects read for it (a new
        reference), or None if they do not have the shape expected."""
        shape = self.layout.chunk_shape(c.key.num_tokens // self.settings.block_size)
        native = c.source_tp in (0, self.topology.tp_size)
        if not native:
            axis = self.layout.head_axis
            if axis is None:
                log.warning("kvtier: layout %s cannot assemble shards of TP %d; recomputing", self.layout.name,
                            c.source_tp)
                return None
            per = self.topology.heads // c.source_tp
            shape_src = shape[:axis] + (per,) + shape[axis + 1:]
        for obj in got:
            h = obj.header
            want = shape if native else shape_src
            if h.shape != want or h.dtype != self.settings.kv_dtype:
                log.warning("kvtier: chunk %s has shape %s %s, expected %s %s; recomputing",
                            c.key.hex[:16], h.shape, h.dtype, want, self.settings.kv_dtype)
                return None
        if native:
            return got[0].retain()
        return self._assemble(c, got, shape, axis)

    def _assemble(self, c, got: list[ChunkObject], shape, axis: int) -> ChunkObject:
        """Cut this rank's heads out of shards written at another TP size.
        Bytes only, with numpy (a torch kernel here would start an OpenMP
        team of its own beside the engine's): heads lie along ``axis``, each
        head's data contiguous within it."""
        import numpy as np

        es = DTYPE_SIZES[self.settings.kv_dtype]
        first = self.topology.sources(self._shard, c.source_tp)[0]
        per_src = self.topology.heads // c.source_tp
        mine = shape[axis]
        parts = [np.frombuffer(o.payload, dtype=np.uint8).reshape(o.header.shape[:-1] + (o.header.shape[-1] * es,))
                 for o in got]
        whole = np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]
        lo = self._shard * mine - first * per_src
        part = np.ascontiguousarray(whole.take(range(lo, lo + mine), axis=axis))
        obj = encode(self._key(c.key), self.settings.kv_dtype, shape, memoryview(part).cast("B"), self.store.pool)
        try:
            self.store.put([obj])  # our own shard from now on (memory, and written through)
        except Exception as exc:  # a failed save costs a future hit, never this load
            log.warning("kvtier: storing an assembled shard failed: %s", exc)
        self.metrics.assembled_chunks.inc()
        return obj

    def _read_ended(self, flight: _InFlight, fut) -> None:
        """The loader is done with ``flight`` (loader thread): whatever did
        not arrive by now is not loaded."""
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:  # a failed load is a recompute, never a failed request
            log.warning("kvtier: load for %s failed: %s; recomputing", flight.job.req_id, exc)
        with self._lock:
            if not flight.read_done:
                self._reads_ended(flight, time.perf_counter())
        self._arrived.set()

    def _share(self, now: float) -> None:
        """Charge the time since the last count to the loads reading, each
        its 1/n share (lock held). A load's share is the reading time that
        was its own: the scheduler's cost model turns it into the tier's
        one-load-alone rate, which it multiplies by the tokens queued on the
        tier (costs.py), so the loader's concurrency is counted once."""
        if self._reading:
            part = (now - self._shared_at) / len(self._reading)
            for f in self._reading:
                f.share += part
        self._shared_at = now

    def _end_reading(self, flight: "_InFlight", now: float) -> None:
        """``flight`` reads no more (lock held)."""
        if flight in self._reading:
            self._share(now)
            self._reading.remove(flight)

    def _reads_ended(self, flight: "_InFlight", now: float) -> None:
        """``flight`` is done reading, at its end or stopped (lock held);
        the loader's busy time ends with the last load in flight."""
        self._end_reading(flight, now)
        flight.read_done = True
        if self._busy_since is not None and all(f.read_done for f in self._inflight.values()):
            self.metrics.load_busy_seconds.inc(now - self._busy_since)
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
        they were started, a finished load waiting behind an older one that
        is not (every rank then hands vLLM the same requests, whatever order
        its own reads ended in); the others are reported in later steps."""
        with self._lock:
            self._stop_overdue(time.perf_counter())
            waiting = idle and bool(self._inflight) and not any(
                f.arrived or f.read_done for f in self._inflight.values())
            self._arrived.clear()
        if waiting:
            self._arrived.wait(_IDLE_WAIT_S)
        with self._lock:
            self._stop_overdue(time.perf_counter())
            batches = [(f, f.arrived, f.read_done) for f in self._inflight.values() if f.arrived or f.read_done]
            for f, _, _ in batches:
                f.arrived = []
        if not batches:
            return None, None
        t0 = time.perf_counter()
        finished: set[str] = set()
        failed: set[int] = set()
        done = []
        for flight, objs, read_done in batches:
            flight.copy_in(self, objs)
            # Everything that will arrive has, and is in the engine's blocks
            # (device copies completed): it may be reported.
            if read_done and flight.copies_done(self):
                done.append(flight)
        if release:
            ready = {id(f) for f in done}
            done = list(itertools.takewhile(lambda f: id(f) in ready, self._inflight.values()))[:release]
        for flight in done:
            failed |= flight.missing_blocks()
            finished.add(flight.job.req_id)
            self._reads[flight.job.req_id] = (flight.share, flight.loaded_tokens(self.settings.block_size))
            if flight.stopped:
                self._stopped[flight.job.req_id] = flight.stopped
        self.metrics.scatter_seconds.observe(time.perf_counter() - t0)
        with self._lock:
            for rid in finished:
                del self._inflight[rid]
            self._errors_to_report |= failed
        return None, finished or None

    def worker_meta(self, step: int = 0) -> KVTierWorkerMeta | None:
        """The read times of the loads reported finished since the last call
        (engine thread, once per step), with the number of the step: the
        scheduler's cost model learns each tier's speed and each step's
        time from them (costs.py). None only when there is neither."""
        if not self._reads and not step:
            return None
        meta, self._reads, self._stopped = KVTierWorkerMeta(self._reads, self._stopped, step), {}, {}
        return meta

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
            self._save(job)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)

    def _save(self, job: SaveJob) -> None:
        if self.device is not None:
            self._save_from_device(job)
            return
        layout, dtype = self.layout, self.layout.dtype
        objs: list[ChunkObject] = []
        try:
            for c in job.chunks:
                shape = layout.chunk_shape(len(c.block_ids))

                def fill(buf, ids=c.block_ids, shape=shape):
                    layout.gather(ids, torch.frombuffer(buf, dtype=dtype).view(shape))

                objs.append(build(self._key(c.key), self.settings.kv_dtype, shape, fill, self.store.pool))
            self.store.put(objs)
            self.metrics.saved_chunks.inc(len(objs))
        except Exception as exc:  # a failed save costs a future hit, never this request
            log.warning("kvtier: save for %s failed: %s", job.req_id, exc)
        finally:
            for o in objs:
                o.release()

    def _save_from_device(self, job: SaveJob) -> None:
        """Enqueue each chunk's device-to-host copy behind this step's
        forward (the host does not wait); the saver thread hands the bytes
        to the store once the copy completed."""
        try:
            pending = [(c, self.device.save(c.block_ids)) for c in job.chunks]
        except Exception as exc:  # a failed save costs a future hit, never this request
            log.warning("kvtier: save for %s failed: %s", job.req_id, exc)
            return
        self._saver.submit(STORE, self._store_saved, job.req_id, pending)

    def _store_saved(self, req_id: str, pending) -> None:
        objs: list[ChunkObject] = []
        try:
            for c, p in pending:
                payload = self.device.saved_bytes(p)  # waits for the copy
                objs.append(encode(self._key(c.key), self.settings.kv_dtype, p.shape, payload, self.store.pool))
            self.store.put(objs)
            self.metrics.saved_chunks.inc(len(objs))
        except Exception as exc:
            log.warning("kvtier: save for %s failed: %s", req_id, exc)
        finally:
            for o in objs:
                o.release()
            for _, p in pending:
                self.device.release(p)

    def close(self) -> None:
        if self._saver is not None:
            self._saver.close()
        self._loader.close()
        self.store.close()


class _InFlight:
    """One asynchronous load: chunks arrive from the loader thread in order
    (``arrived``, guarded by the worker's lock) and are copied in by the
    engine thread (``copied``, engine thread only)."""

    def __init__(self, job: LoadJob):
        self.job = job
        self.arrived: list[ChunkObject] = []
        self.read_done = False  # set by the loader's end, or by a stop at the budget
        self.reading_since: float | None = None  # perf_counter when its reads started (loader thread)
        self.share = 0.0  # seconds of reading that were its own (``KVTierWorker._share``; lock)
        self.received = 0  # leading chunks handed over by the loader (lock)
        self.stopped = ""  # why it was stopped early: "budget" or "projected" (lock)
        self.copied = 0  # leading chunks copied into the engine
        self.broken = False  # a copy failed: nothing more is copied
        self.pending: list = []  # device copies enqueued, not yet known complete

    def copy_in(self, worker: KVTierWorker, objs: list[ChunkObject]) -> None:
        layout = worker.layout
        try:
            for obj in objs:
                if self.broken:
                    break
                c = self.job.chunks[self.copied]
                try:
                    if worker.device is not None:
                        self.pending.append(worker.device.load(c.block_ids, obj.payload, obj.header.shape, c.skip))
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

    def copies_done(self, worker: KVTierWorker) -> bool:
        """Whether every device copy of this load completed (their staging
        goes back to the pool); always true on CPU, where copies are done
        when ``copy_in`` returns."""
        while self.pending and self.pending[0].finished():
            worker.device.release(self.pending.pop(0))
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


def _tokens(chunks, block_size: int) -> int:
    """Tokens a load writes into the engine for ``chunks``."""
    return sum(len(c.block_ids) - c.skip for c in chunks) * block_size
