"""Scheduler side: decides what to load and what to save. Moves no bytes.

Threads: vLLM's scheduler thread calls every method here. Lookups run on a
small pool of this object's own (``_lookups``) so that the scheduler never
waits on storage: a request whose lookup is still running is answered
"ask again next step" (``None``), as vLLM's contract allows.

Per request it keeps the lookup answer, the chunk keys of its tokens (a
prefix chain, extended as tokens are computed), its engine block ids, and how
far its KV is already in kvtier (``saved_upto``).

Keys here are the TP group's chain; each worker names its own shard of a
chunk from it. Lookups ask ``GroupView``, which sees every rank's tiers from
this process: a chunk counts only when every rank's shard of it is stored.

A hit is claimed only as far as loading it, behind the loads already
queued on its tier, beats recomputing it (``LoadCosts``, costs.py): the
engine's step times and the workers' read times (their
``KVTierWorkerMeta``) keep both rates current. Each asynchronous load
carries a budget, so that a load from a tier slower than measured (or not
measured yet) stops and leaves the rest to the engine.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.eligibility import cacheable, must_compute_prompt
from kvtier.integrations.vllm.enginewait import QuietWhileLoading
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.lookup import Hit, all_in_memory, longest_prefix, tiers_in
from kvtier.integrations.vllm.metadata import ChunkIO, KVTierMetadata, KVTierWorkerMeta, LoadJob, SaveJob, merge_reads
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.settings import Settings
from kvtier.keys import ChunkKey, next_key, root_key

log = logging.getLogger(__name__)

# A lookup answered from memory or the disk index takes microseconds: wait
# this long before deferring the request by a scheduler step.
_LOOKUP_GRACE_S = 0.005
# How often a read-back probe looks for the chunk a save is writing.
_READ_BACK_POLL_S = 0.1


@dataclass
class _Req:
    request: Any
    root: ChunkKey
    full_keys: list[ChunkKey] = field(default_factory=list)  # full chunks, chained
    lookup: Future | None = None
    lookup_usable: int = -1
    local_tokens: int = 0  # vLLM's own prefix hit when we answered
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # tokens (chunk-aligned) already in kvtier
    tail_saved: bool = False
    loading_blocks: set[int] | None = None
    bad_blocks: set[int] = field(default_factory=set)  # of loading_blocks, reported failed so far
    load_failed: bool = False  # a rank reported the load failed (failed_recving)
    sync_load: bool = False
    failed: bool = False  # a load failed, or the request is not cacheable: never claim
    skipped: bool = False  # counted once as a request that must compute its whole prompt
    answered: bool = False  # its lookup was answered: it is ahead of requests asked after it
    claim: tuple[Future, int, int] | None = None  # (lookup, vLLM's hit, tokens claimed up to): decided once
    load_tier: str = ""  # an async load in flight: the slowest tier it reads from
    read: tuple[float, int] | None = None  # its (seconds, tokens loaded), over the ranks reported so far
    stopped: str = ""  # a rank stopped its load early: why ("budget", "projected")
    load_sent: float = 0.0  # perf_counter when its asynchronous load went to the workers


def _done_hit(st: "_Req | None") -> "Hit | None":
    """The request's finished lookup answer; None while it runs, or if it
    failed (a failed lookup is a miss, never a failed request)."""
    if st is None or st.lookup is None or not st.lookup.done() or st.lookup.cancelled():
        return None
    if st.lookup.exception() is not None:
        return None
    return st.lookup.result()


class KVTierScheduler:
    def __init__(self, settings: Settings, view: GroupView, metrics: ConnectorMetrics, bytes_per_token: float = 0.0):
        """``bytes_per_token``: of every shard of a chunk together (turns
        the configured ``read_rates`` seeds into load time per token)."""
        self.settings = settings
        self.view = view
        self.metrics = metrics
        self.bs = settings.block_size
        self.chunk = settings.store.chunk_tokens
        self._reqs: dict[str, _Req] = {}
        self._roots: dict[str, ChunkKey] = {}
        self._lookups = PriorityExecutor("vllm-lookup", 2)
        self._prober = PriorityExecutor("vllm-probe", 1)  # re-measures slow tiers, apart from lookups
        self._pending_loads: list[LoadJob] = []
        self._probes: list[tuple[str, Future]] = []  # background re-measurements of slow tiers
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

    def set_page(self, page: str) -> None:
        """The workers' page layout (their handshake, before any request):
        it completes the namespace, and kvtier starts claiming and saving."""
        self.settings = self.settings.with_page(page)
        self._roots.clear()
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

    # ------------------------------------------------------------ keys
    def _state(self, request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = request.cache_salt or ""
            root = self._roots.get(salt)
            if root is None:
                root = self._roots[salt] = root_key(self.settings.namespace.with_salt(salt).digest())
            st = self._reqs[request.request_id] = _Req(request, root)
            st.failed = not cacheable(request)
        st.request = request
        return st

    def _full_key(self, st: _Req, index: int, tokens) -> ChunkKey:
        """Key of full chunk ``index`` (tokens [index*C, (index+1)*C))."""
        while len(st.full_keys) <= index:
            i = len(st.full_keys)
            prev = st.full_keys[-1] if st.full_keys else st.root
            st.full_keys.append(next_key(prev, list(tokens[i * self.chunk : (i + 1) * self.chunk])))
        return st.full_keys[index]

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
            skip = self.costs.ruled_out() if self.settings.decision.mode == "auto" else frozenset()
            for tier in skip:
                self.metrics.recompute_decisions.labels(tier, "not_asked").inc()
                if len(tokens) >= self.chunk and self.costs.start_probe(tier):
                    # Re-measure it in the background with this prompt's first
                    # chunk, if the tier holds it; this request goes on without it.
                    key = next_key(st.root, tokens[: self.chunk])
                    cfg = self.settings.store
                    self._probes.append((tier, self._prober.submit(
                        LOAD, self.view.probe, tier, key, cfg.lookup_timeout_s, cfg.load_timeout_s)))
            if all_in_memory(self.view, self.chunk, self.bs, st.root, tokens) or self._persistent <= skip:
                # Answered from host memory alone (every tier that does I/O
                # is left out, or every chunk is in memory): no reason to defer.
                st.lookup = Future()
                st.lookup.set_result(longest_prefix(self.view, self.chunk, self.bs, st.root, tokens, usable, skip))
            else:
                st.lookup = self._lookups.submit(LOAD, longest_prefix, self.view, self.chunk, self.bs, st.root, tokens,
                                                 usable, skip)
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
        end = self._claim(st, hit, num_computed_tokens)
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

    def _claim(self, st: _Req, hit: "Hit", lo: int) -> int:
        """Where the claimed part of ``hit`` ends (tokens): all of it, or up
        to the first chunk past vLLM's own hit ``lo`` whose tier loads slower
        than the engine recomputes, behind the loads queued there. Decided once per lookup answer and hit,
        so that vLLM's repeated asks get one answer; a cut is counted."""
        if hit.tokens <= lo or self.settings.decision.mode == "always":
            return hit.tokens
        if st.claim is not None and st.claim[0] is st.lookup and st.claim[1] == lo:
            return st.claim[2]
        starts, pos = [], 0
        for k in hit.keys:
            starts.append(pos)
            pos += k.num_tokens
        first = next(i for i, k in enumerate(hit.keys) if starts[i] + k.num_tokens > lo)
        tokens = [min(starts[i] + k.num_tokens, hit.tokens) - max(starts[i], lo)
                  for i, k in enumerate(hit.keys) if i >= first]
        ahead = self._queued_tokens()
        waiting = sum(1 for other in self._reqs.values() if other.loading_blocks is not None and not other.sync_load)
        n, stopped = self.costs.claimable(hit.tiers[first:], tokens, ahead, self._engine_backlog(st), waiting)
        end = hit.tokens if first + n >= len(hit.keys) else max(lo, starts[first + n])
        if stopped is not None and end < hit.tokens:
            reason = "queued" if ahead.get(stopped) and self.costs.pays_off(stopped) else "cut"
            self.metrics.recompute_decisions.labels(stopped, reason).inc()
            self.metrics.recomputed_hit_tokens.labels(stopped).inc(hit.tokens - end)
        st.claim = (st.lookup, lo, end)
        return end

    def _release(self) -> int:
        """How many finished loads the workers may hand to the engine this
        step (0: all): one while two or more loads are in flight and the
        engine would take longer to compute their suffixes than a step's
        fixed cost (``LoadCosts.pace_loads``)."""
        if self.settings.decision.mode != "auto":
            return 0
        suffixes = sorted(st.request.num_tokens - st.claim[2] for st in self._reqs.values()
                          if st.loading_blocks is not None and not st.sync_load and st.claim is not None)
        if len(suffixes) < 2:
            return 0
        return 1 if self.costs.pace_loads(suffixes[len(suffixes) // 2]) else 0

    def _engine_backlog(self, mine: _Req) -> int:
        """Prompt tokens the engine has yet to compute for the requests
        answered before ``mine`` and not loading: the queue a recomputed
        request would wait behind (a loaded one reads meanwhile)."""
        out = 0
        for st in self._reqs.values():
            if st is mine or not st.answered or st.loading_blocks is not None:
                continue
            req = st.request
            out += max(0, getattr(req, "num_prompt_tokens", 0) - getattr(req, "num_computed_tokens", 0))
        return out

    def _queued_tokens(self) -> dict[str, int]:
        """Per tier, tokens of the asynchronous loads claimed there and not
        reported done: a new load from the tier waits behind them."""
        out: dict[str, int] = {}
        for st in self._reqs.values():
            if st.loading_blocks is not None and not st.sync_load:
                out[st.load_tier] = out.get(st.load_tier, 0) + len(st.loading_blocks) * self.bs
        return out

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

    def _claimed_by_tier(self, st: _Req | None, num_external_tokens: int) -> dict[str, int]:
        """Tokens of the claimed hit, by the slowest tier holding each chunk."""
        hit = _done_hit(st)
        if not num_external_tokens or hit is None:
            return {}
        lo, hi = st.local_tokens, st.local_tokens + num_external_tokens
        by_tier: dict[str, int] = {}
        pos = 0
        for k, tier in zip(hit.keys, hit.tiers):
            a, b = max(pos, lo), min(pos + k.num_tokens, hi)
            if b > a:
                by_tier[tier] = by_tier.get(tier, 0) + b - a
            pos += k.num_tokens
        return by_tier

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
        hit = _done_hit(st)
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
        meta = KVTierMetadata(loads=self._pending_loads, idle=not scheduled_tokens, release=self._release(), step=step)
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

    def _plan_saves(self, st: _Req, computed: int, meta: KVTierMetadata) -> None:
        """Save every chunk whose KV is complete after this step: full chunks
        as they fill, and at the end of the prompt its whole-block tail."""
        if not cacheable(st.request) or self._nowhere_to_save():
            return
        req, C, bs = st.request, self.chunk, self.bs
        whole = min(computed, len(req.all_token_ids)) // bs * bs
        tokens = req.all_token_ids
        chunks: list[ChunkIO] = []
        while st.saved_upto + C <= whole:
            i = st.saved_upto // C
            key = self._full_key(st, i, tokens)
            chunks.append(ChunkIO(key, st.block_ids[i * C // bs : (i + 1) * C // bs]))
            st.saved_upto += C
        if not st.tail_saved and computed >= req.num_prompt_tokens and whole > st.saved_upto:
            i = st.saved_upto // C
            prev = self._full_key(st, i - 1, tokens) if i else st.root
            key = next_key(prev, list(tokens[st.saved_upto : whole]))
            chunks.append(ChunkIO(key, st.block_ids[st.saved_upto // bs : whole // bs]))
            st.tail_saved = True
        chunks = [c for c in chunks if len(c.block_ids) * bs == c.key.num_tokens]
        if chunks:
            meta.saves.append(SaveJob(req.request_id, chunks))
            self._calibrate(chunks[0].key)

    def _nowhere_to_save(self) -> bool:
        """No host memory and every persistent tier ruled out (slower to read
        than the engine computes): what would be saved could not be loaded
        with profit until a tier recovers, and the writes would only add to
        the load of a tier already too slow. Saves resume once a probe finds
        a tier fast again."""
        return (self.settings.decision.mode == "auto" and not self.view.host_memory
                and bool(self._persistent) and self._persistent <= self.costs.ruled_out())

    def _calibrate(self, key: ChunkKey) -> None:
        """Measure each persistent tier whose rate is not known on ``key``,
        a chunk just saved, once it is stored there: in the background, so
        that the resumes after this prefill know what loading costs."""
        if self.settings.decision.mode != "auto":
            return
        for tier in sorted(self._persistent):
            if self.costs.start_calibration(tier):
                self._probes.append((tier, self._prober.submit(LOAD, self._read_back, tier, key)))

    def _read_back(self, tier: str, key: ChunkKey) -> tuple[float, int] | None:
        """Probe ``tier`` with ``key`` once the save reached it (probe
        thread): the write-through is asynchronous, so look until it is
        there, for as long as a probe may take."""
        cfg = self.settings.store
        deadline = time.monotonic() + self.settings.decision.probe_interval_s
        while True:
            got = self.view.probe(tier, key, cfg.lookup_timeout_s, cfg.load_timeout_s)
            if got is not None or time.monotonic() > deadline:
                return got
            time.sleep(_READ_BACK_POLL_S)

    def _probed(self) -> None:
        """Feed finished background probes to the cost model (scheduler thread)."""
        done = [(t, f) for t, f in self._probes if f.done()]
        if not done:
            return
        self._probes = [(t, f) for t, f in self._probes if not f.done()]
        for tier, fut in done:
            if fut.cancelled() or fut.exception() is not None:
                self.costs.load_ended(tier)
                continue
            if fut.result() is None:
                # The tier did not hold that chunk: a later probe tries again
                # (a read-back after the next save; a re-measure once due).
                if not self.costs.measured(tier):
                    self.costs.load_ended(tier)
                continue
            seconds, tokens = fut.result()
            self._measured(tier, seconds, max(tokens, 1))

    def update_connector_output(self, output) -> None:
        timings = getattr(output, "kv_connector_worker_meta", None)
        self.costs.step_done(timings.step or None if isinstance(timings, KVTierWorkerMeta) else None)
        self._probed()
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

    def _timed(self, st: _Req) -> None:
        """An asynchronous load ended: what it took teaches the cost model."""
        if st.read is None:
            self.costs.load_ended(st.load_tier)
            return
        seconds, tokens = st.read
        # Nothing arrived in all that time: as slow as one token per ``seconds``.
        self._measured(st.load_tier, seconds, max(tokens, 1))

    def _measured(self, tier: str, seconds: float, tokens: int) -> None:
        """A load or probe of ``tier`` took ``seconds`` for ``tokens``: into
        the cost model, the gauge, and the log when the verdict flips."""
        was = self.costs.pays_off(tier)
        self.costs.loaded(tier, seconds, tokens)
        rate = self.costs.tiers.get(tier)
        if rate is None or rate.value is None:
            return
        self.metrics.load_seconds_per_token.labels(tier).set(rate.value)
        now = self.costs.pays_off(tier)
        if now != was:
            prefill = self.costs.prefill.value or 0.0
            log.warning("kvtier: tier %s loads at %.3f ms per token, the engine computes at %.3f ms: %s", tier,
                        rate.value * 1e3, prefill * 1e3,
                        "loading from it again" if now else "leaving its hits to the engine until it is faster")

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.lookup is not None:
            st.lookup.cancel()
        return False, None

    def close(self) -> None:
        self._quiet.close()
        self._lookups.close(cancel_pending=True)
        self._prober.close(cancel_pending=True)
        self.view.close()
