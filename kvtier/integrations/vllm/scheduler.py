"""Scheduler side: decides what to load and what to save. Moves no bytes.

Threads: vLLM's scheduler thread calls every method here. Lookups run on a
small pool of this object's own (``_lookups``) so that the scheduler never
waits on storage: a request whose lookup is still running is answered
"ask again next step" (``None``), as vLLM's contract allows.

Per request it keeps a ``RequestState`` (state.py): the lookup answer, the
chunk keys of its tokens (its ``KeyChain``, chain.py: made once, for
lookups and saves alike), its engine block ids, and how far its KV is
already in kvtier (``saved_upto``).

Keys here are the TP group's chain; each worker names its own shard of a
chunk from it. Lookups ask ``GroupView``, which sees every rank's tiers from
this process: a chunk counts only when every rank's shard of it is stored.

A hit is claimed only as far as loading it, behind the loads already
queued on its tier, beats recomputing it (``Claims``, claims.py, on the
cost model ``LoadCosts``, costs.py): the engine's step times and the
workers' read times (their ``KVTierWorkerMeta``) keep both rates current,
and probes measure the tiers no load does (probes.py). Each asynchronous
load carries a budget, so that a load from a tier slower than measured (or
not measured yet) stops and leaves the rest to the engine.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout

from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier.integrations.vllm.chain import KeyChains
from kvtier.integrations.vllm.claims import Claims
from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.eligibility import cacheable, must_compute_prompt
from kvtier.integrations.vllm.enginewait import QuietWhileLoading
from kvtier.integrations.vllm.events import BlockEvents, Journals
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.lookup import Hit, all_in_memory, longest_prefix, tiers_in
from kvtier.integrations.vllm.metadata import ChunkIO, KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob, merge_reads
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.probes import TierProbes
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.state import RequestState, done_hit

log = logging.getLogger(__name__)

# A lookup answered from memory or the disk index takes microseconds: wait
# this long before deferring the request by a scheduler step.
_LOOKUP_GRACE_S = 0.005


class KVTierScheduler:
    def __init__(self, settings: Settings, view: GroupView, metrics: ConnectorMetrics, bytes_per_token: float = 0.0,
                 events: BlockEvents | None = None):
        """``bytes_per_token``: of every shard of a chunk together (turns
        the configured ``read_rates`` seeds into load time per token).
        ``events``: with vLLM's KV events on, the tiers' events (events.py):
        told of every chunk saved or loaded, and of what the ranks heard."""
        self.settings = settings
        self.events = events
        self.view = view
        self.metrics = metrics
        self.bs = settings.block_size
        self.chunk = settings.store.chunk_tokens
        self._reqs: dict[str, RequestState] = {}
        self._chains = KeyChains(settings.namespace, self.chunk)
        self._lookups = PriorityExecutor("vllm-lookup", 2)
        self._pending_loads: list[LoadJob] = []
        self._warned_unready = False
        self._persistent = frozenset(view.kinds) - frozenset(view.host_memory)  # tiers that do I/O
        # While a load is in flight the engine core waits for its workers
        # without spinning (enginewait.py): the load needs the cores.
        self._quiet = QuietWhileLoading(enabled=not settings.spin_during_loads)
        d = settings.decision
        self.costs = LoadCosts.seeded(
            view.host_memory, self.chunk, d.prefill_tokens_per_s,
            {tier: bytes_per_token / rate for tier, rate in d.read_rates if bytes_per_token}, d.probe_interval_s,
            settings.load_threads)
        self.claims = Claims(self.costs, metrics, self.bs, d.mode)
        self.probes = TierProbes(view, self.costs, metrics, settings.store, d, self._persistent)
        # What other nodes' collectors deleted from the shared tiers, for the events.
        self._journals = Journals(view.stores[0].tiers, self._lookups) if events is not None else None

    def set_page(self, page: str) -> None:
        """The workers' page layout (their handshake, before any request):
        it completes the namespace, and kvtier starts claiming and saving."""
        self.settings = self.settings.with_page(page)
        self._chains = KeyChains(self.settings.namespace, self.chunk)
        log.info("kvtier: workers' pages %s; namespace %s", page, self.settings.namespace.digest().hex())

    def _unready(self) -> bool:
        """True (and warned once) while the workers' page layout is unknown:
        keys made now would name pages kvtier has not seen."""
        if not self.settings.awaiting_page:
            return False
        if not self._warned_unready:
            self._warned_unready = True
            log.warning("kvtier: no page layout from the workers yet (vLLM did not hand over their handshake); "
                        "caching nothing until it does")
        return True

    # ------------------------------------------------------------ requests
    def _state(self, request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = RequestState(request, self._chains.chain(request.cache_salt))
            st.failed = not cacheable(request)
        st.request = request
        return st

    # ------------------------------------------------------------ lookup
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._unready():
            return 0, False
        st = self._state(request)
        if st.failed:
            return 0, False
        if must_compute_prompt(request):
            if not st.skipped:
                st.skipped = True
                self.metrics.skipped_requests.inc()
            return 0, False
        usable = (request.num_tokens - 1) // self.bs * self.bs  # leave one token to compute
        if usable <= num_computed_tokens:
            return 0, False
        if st.lookup is None or st.lookup_usable != usable:
            # Keys over every known token: a stored chunk that runs past the
            # usable end still serves its leading blocks.
            tokens = list(request.all_token_ids[: request.num_tokens])
            st.lookup_usable = usable
            t0 = time.perf_counter()
            prompt = st.keys.prompt(tokens, len(tokens) // self.bs * self.bs)
            skip = self.costs.ruled_out() if self.settings.decision.mode == "auto" else frozenset()
            for tier in skip:
                self.metrics.recompute_decisions.labels(tier, "not_asked").inc()
                if len(tokens) >= self.chunk and self.costs.start_probe(tier):
                    # Re-measure it in the background with this prompt's first
                    # chunk, if the tier holds it; this request goes on without it.
                    self.probes.remeasure(tier, prompt.keys[0])
            if all_in_memory(self.view, prompt) or self._persistent <= skip:
                # Answered from host memory alone (every tier that does I/O
                # is left out, or every chunk is in memory): no reason to defer.
                st.lookup = Future()
                st.lookup.set_result(longest_prefix(self.view, prompt, self.bs, usable, skip))
            else:
                st.lookup = self._lookups.submit(LOAD, longest_prefix, self.view, prompt, self.bs, usable, skip)
            st.lookup.add_done_callback(
                lambda _f, t0=t0: self.metrics.lookup_seconds.observe(time.perf_counter() - t0))
        try:
            hit: Hit = st.lookup.result(timeout=_LOOKUP_GRACE_S)
        except FutureTimeout:
            self.metrics.lookup_deferred.inc()
            return None, False
        except Exception as exc:  # a lookup must never fail a request
            log.warning("kvtier lookup failed for %s: %s", request.request_id, exc)
            return 0, False
        st.local_tokens = num_computed_tokens
        st.answered = True
        end = self.claims.end(st, hit, num_computed_tokens, self._reqs.values())
        if end <= num_computed_tokens:
            return 0, False
        # Chunks in host memory are copied in within this step, before the
        # forward (a synchronous load: no extra scheduler round trip); anything
        # on disk or remote is read asynchronously while other requests run.
        # (Shards of another TP size are assembled on the loader thread.)
        st.sync_load = all(
            t in self.view.host_memory for t in tiers_in(hit, num_computed_tokens, end)
        ) and not any(hit.sources)
        return end - num_computed_tokens, not st.sync_load

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        out: dict = {}
        for tier, n in self._claimed_by_tier(self._reqs.get(request.request_id), num_external_tokens).items():
            if tier in self.view.host_memory:
                src = CacheHitSource.HOST
            elif self.view.kinds.get(tier) == "disk":
                src = CacheHitSource.DISK
            else:
                src = CacheHitSource.EXTERNAL_UNSPECIFIED
            out[src] = out.get(src, 0) + n
        return out

    def _claimed_by_tier(self, st: RequestState | None, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the claimed hit, by the slowest tier holding each chunk."""
        hit = done_hit(st)
        if not num_external_tokens or hit is None:
            return {}
        return hit.tokens_by_tier(st.local_tokens, st.local_tokens + num_external_tokens)

    # ------------------------------------------------------------ allocation
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self._unready():
            return
        st = self._state(request)
        block_ids = list(blocks.get_block_ids()[0])
        # Counted here, where every vLLM from 0.30 reports the claim
        # (get_external_cache_hit_sources exists from 0.32 only); a claim for
        # a request vLLM preempted and runs again is not, as vLLM counts it
        # apart from external_prefix_cache_hits (its preempted_hits).
        if not getattr(request, "num_preemptions", 0):
            for tier, n in self._claimed_by_tier(st, num_external_tokens).items():
                self.metrics.external_hit_tokens.labels(tier).inc(n)
        hit = done_hit(st)
        if hit is not None and not st.failed:
            # Chunks kvtier already holds need no save; a partial last chunk
            # is saved again once its full version exists. (Not after a failed
            # load: the hit was not there after all.)
            full = [k for k in hit.keys if k.num_tokens == self.chunk]
            st.saved_upto = max(st.saved_upto, len(full) * self.chunk)
        if num_external_tokens <= 0 or hit is None:
            return
        lo, hi = st.local_tokens, st.local_tokens + num_external_tokens
        chunks, tiers, pos = [], [], 0
        for k, tier, src in zip(hit.keys, hit.tiers, hit.sources or [0] * len(hit.keys)):
            start, end = pos, pos + k.num_tokens
            pos = end
            if end <= lo or start >= hi:
                continue
            # Blocks of this chunk up to the claimed end: the chunk may run past it.
            ids = block_ids[start // self.bs : min(end, hi) // self.bs]
            if self.events is not None and not src:
                self.events.remember(k, request, start)  # promoted into memory as it loads
            chunks.append(ChunkIO(k, ids, skip=(max(start, lo) - start) // self.bs, source_tp=src))
            tiers.append(tier)
        st.loading_blocks = {b for c in chunks for b in c.block_ids[c.skip :]}
        st.load_tier, st.read, st.stopped = self.view.slowest(tiers), None, ""
        bounded = self.settings.decision.mode == "auto" and not st.sync_load  # "always" loads however slowly
        self._pending_loads.append(LoadJob(
            request.request_id, chunks, tiers, sync=st.sync_load,
            budget_s=self.costs.budget(st.load_tier, len(st.loading_blocks) * self.bs) if bounded else None,
            prefill_s_per_token=self.costs.prefill.value if bounded else None))

    # ------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        scheduled_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        step = self.costs.step_scheduled(scheduled_tokens)
        meta = KVTierMetadata(loads=self._pending_loads, idle=not scheduled_tokens,
                              release=self.claims.release(self._reqs.values()), step=step)
        self._pending_loads = []
        if meta.loads:
            self._quiet.loading(True)
        for job in meta.loads:
            if not job.sync and job.req_id in self._reqs:
                self._reqs[job.req_id].load_sent = time.perf_counter()
        scheduled = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            self._plan_saves(st, nr.num_computed_tokens + scheduled.get(nr.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan_saves(st, cached.num_computed_tokens[i] + scheduled.get(rid, 0), meta)
        return meta

    def _plan_saves(self, st: RequestState, computed: int, meta: KVTierMetadata) -> None:
        """Save every chunk whose KV is complete after this step: full chunks
        as they fill, and at the end of the prompt its whole-block tail."""
        if not cacheable(st.request) or self._nowhere_to_save():
            return
        req, C, bs = st.request, self.chunk, self.bs
        whole = min(computed, len(req.all_token_ids)) // bs * bs
        tokens = req.all_token_ids
        first = st.saved_upto  # chunk j of this step's starts at first + j*C
        chunks: list[ChunkIO] = []
        while st.saved_upto + C <= whole:
            i = st.saved_upto // C
            key = st.keys.full(i, tokens)
            chunks.append(ChunkIO(key, st.block_ids[i * C // bs : (i + 1) * C // bs]))
            st.saved_upto += C
        if not st.tail_saved and computed >= req.num_prompt_tokens and whole > st.saved_upto:
            key = st.keys.tail(tokens, st.saved_upto, whole)
            chunks.append(ChunkIO(key, st.block_ids[st.saved_upto // bs : whole // bs]))
            st.tail_saved = True
        starts = {id(c): first + j * C for j, c in enumerate(chunks)}
        chunks = [c for c in chunks if len(c.block_ids) * bs == c.key.num_tokens]
        if chunks:
            meta.saves.append(SaveJob(req.request_id, chunks))
            if self.events is not None:
                for c in chunks:
                    self.events.remember(c.key, req, starts[id(c)])
            self.probes.calibrate(chunks[0].key)

    def _nowhere_to_save(self) -> bool:
        """No host memory and every persistent tier ruled out (slower to read
        than the engine computes): what would be saved could not be loaded
        with profit until a tier recovers, and the writes would only add to
        the load of a tier already too slow. Saves resume once a probe finds
        a tier fast again."""
        return (self.settings.decision.mode == "auto" and not self.view.host_memory
                and bool(self._persistent) and self._persistent <= self.costs.ruled_out())

    def update_connector_output(self, output) -> None:
        timings = getattr(output, "kv_connector_worker_meta", None)
        self.costs.step_done(timings.step or None if isinstance(timings, KVTierWorkerMeta) else None)
        self.probes.collect()
        if self.costs.prefill.value is not None:
            self.metrics.prefill_seconds_per_token.set(self.costs.prefill.value)
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        failed_ids = set(getattr(output, "failed_recving", None) or ())
        finished = set(output.finished_recving or ())
        if isinstance(timings, KVTierWorkerMeta):
            for rid, read in timings.reads.items():
                st = self._reqs.get(rid)
                if st is not None:
                    st.read = merge_reads(st.read, read)
            for rid, why in timings.stopped.items():
                if rid in self._reqs:
                    self._reqs[rid].stopped = self._reqs[rid].stopped or why
            if self.events is not None and timings.events:
                self.events.heard(timings.events)
        if self._journals is not None:
            for tier, digests in self._journals.poll():
                self.events.journaled(tier, digests)
        in_flight = False
        for rid, st in self._reqs.items():
            if st.loading_blocks is None:
                continue
            # Under tensor parallelism each rank reports its failed blocks
            # when its own load ends, while vLLM reports the load finished
            # only once every rank has: collect them until then.
            st.bad_blocks |= st.loading_blocks & invalid
            st.load_failed |= rid in failed_ids
            # Async loads end when vLLM reports them; synchronous ones within
            # the step they were scheduled in.
            if not (st.sync_load or rid in finished):
                in_flight = True
                continue
            if not st.sync_load:
                self._timed(st)
                self.metrics.load_wait_seconds.observe(time.perf_counter() - st.load_sent)
            if st.stopped:
                self.metrics.stopped_loads.labels(st.load_tier, st.stopped).inc()
            bad = st.bad_blocks
            if st.load_failed or bad:
                st.failed = True  # never claim again: vLLM would ask once more and loop
                if not st.stopped:
                    # What could not be loaded (corrupt, evicted, truncated)
                    # is recomputed now: save it again, or the hole stays for
                    # the next request with this prefix. (A stopped load's
                    # chunks are stored, only slow to read.)
                    st.saved_upto, st.tail_saved = 0, False
                self.metrics.load_failed_blocks.inc(len(bad))
            st.loading_blocks, st.bad_blocks, st.load_failed = None, set(), False
        self._quiet.loading(in_flight)

    def _timed(self, st: RequestState) -> None:
        """An asynchronous load ended: what it took teaches the cost model."""
        if st.read is None:
            self.costs.load_ended(st.load_tier)
            return
        seconds, tokens = st.read
        # Nothing arrived in all that time: as slow as one token per ``seconds``.
        self.probes.measured(st.load_tier, seconds, max(tokens, 1))

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        return False, None

    def close(self) -> None:
        self._quiet.close()
        self._lookups.close(cancel_pending=True)
        self.probes.close()
        self.view.close()
