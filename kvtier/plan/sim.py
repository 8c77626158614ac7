"""The replay: requests through engines, kvtier's tiers and a TTFT model.

Per request, in the order the vLLM connector does it
(``kvtier/integrations/vllm/scheduler.py``, ``engine/store.py``):

1. The engine's own prefix cache answers first (``EngineModel.match``),
   leaving at least one token to compute.
2. If that leaves usable blocks, kvtier looks up the chunk keys of the
   prompt's whole blocks (full chunks, the last one shorter), tier by tier,
   fastest first, the longest contiguous prefix; where full chunks stop, a
   shorter chunk (whole blocks) an earlier, shorter prompt stored may serve.
3. The load reads the hit chunks that end past the engine's own hit: those
   in lower tiers are read there (disk reads refresh their LRU position,
   shared reads their stamp) and promoted into memory as the connector's
   loader hands them over; those in memory are copied from it.
4. Saves: every full chunk past kvtier's hit, the prompt's whole-block tail
   at the end of prefill, then full chunks as decoding fills them. A save
   stores into memory and writes through to every lower tier.
5. The engine holds the request's blocks until it finishes (the time the log
   measured, or its prefill's end plus ``decode_s_per_token`` per output
   token), other requests can share them meanwhile; then its full blocks
   join the free queue.

Time: each instance serves prefills one at a time in arrival order (decode
steps are batched with them and not charged). TTFT = wait + load + prefill of
the tokens not cached. The same pass computes the baseline without kvtier
(the engine's prefix cache only) and the cost of a full recompute.

The simulator is single-threaded and deterministic for a given seed.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.bench.models import ModelShape
from kvtier.plan.cost import DEFAULT_COPY_GBPS, PrefillModel, TierIO
from kvtier.plan.models import EngineModel, LRUModel, SharedModel
from kvtier.plan.stack import StreamRecorder
from kvtier.plan.storemodel import StoreModel
from kvtier.plan.traces import Request
from kvtier.tiers.eviction import EvictionPolicy, make
from kvtier.tiers.registry import config_class

KINDS = ("memory", "disk", "shared")
# Tags of ids the simulator makes up: ints, so that runs are reproducible
# (hashes of int tuples do not depend on PYTHONHASHSEED; of strings they do).
_GAP, _FRESH = 0x676170, 0x667265
ROUTINGS = ("sticky", "random", "trace")


@dataclass(frozen=True)
class TierPlan:
    kind: str                 # memory | disk (one per instance) | shared (one for all)
    capacity: int             # bytes
    io: TierIO
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    touch_interval_s: float = 60.0
    gc_interval_s: float = 60.0
    eviction: str = ""        # the tier's eviction policy by name; "": its kind's default (the tier config's)

    @property
    def name(self) -> str:
        return self.kind

    @property
    def policy_name(self) -> str:
        return self.eviction or default_eviction(self.kind)

    def policy(self) -> EvictionPolicy:
        """A new, empty eviction policy of this tier, as the tier makes it
        from its config (capacity, watermarks)."""
        return make(self.policy_name, self)


def default_eviction(kind: str) -> str:
    """The eviction policy a tier of ``kind`` runs unless configured: its
    config's default."""
    return config_class(kind).eviction


@dataclass(frozen=True)
class PlanConfig:
    model: ModelShape
    tiers: tuple[TierPlan, ...]
    chunk_tokens: int = 256
    block_tokens: int = 128           # engine KV block = the trace's unit
    engine_blocks: int | None = None  # engine KV capacity in blocks; None: no engine prefix cache
    instances: int = 1
    routing: str = "sticky"
    seed: int = 0
    prefill: PrefillModel = field(default_factory=PrefillModel)
    copy_gbps: float = DEFAULT_COPY_GBPS
    decode_s_per_token: float = 0.0   # how long a request holds its engine blocks after its first token
    promote: bool = True
    curve_sample: float = 1.0         # fraction of keys the capacity curves follow (SHARDS); 0: no curves

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.block_tokens:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} is not a multiple of the block size {self.block_tokens}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} not in {ROUTINGS}")
        kinds = [t.kind for t in self.tiers]
        if kinds != sorted(kinds, key=KINDS.index) or len(set(kinds)) != len(kinds):
            raise ValueError(f"tiers must be distinct and ordered memory, disk, shared; got {kinds}")


@dataclass
class Outcome:
    """What happened to one request."""

    t: float
    instance: int
    prompt_tokens: int
    engine_tokens: int
    tier_tokens: dict[str, int]
    load_s: float
    ttft_s: float
    baseline_ttft_s: float
    recompute_s: float        # TTFT if every prompt were computed in full
    measured_ttft_s: float | None = None
    measured_cached: int | None = None
    phase: str = ""


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    engine_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    read_bytes: dict[str, int] = field(default_factory=dict)
    read_by_second: dict[str, dict[int, int]] = field(default_factory=dict)
    busy_s: float = 0.0
    baseline_busy_s: float = 0.0
    recompute_busy_s: float = 0.0
    t_first: float | None = None
    t_last: float = 0.0


class _Instance:
    def __init__(self, idx: int, engine: EngineModel | None, store: StoreModel):
        self.idx = idx
        self.engine = engine
        self.store = store
        self.busy = 0.0       # with kvtier
        self.busy_base = 0.0  # the engine's prefix cache only
        self.busy_rc = 0.0    # every prompt computed in full


class Simulator:
    def __init__(self, cfg: PlanConfig, keep_outcomes: bool = False):
        self.cfg = cfg
        self.bpt = cfg.model.bytes_per_token
        self.k = cfg.chunk_tokens // cfg.block_tokens
        self.io = {t.kind: t.io for t in cfg.tiers}
        self.rng = random.Random(cfg.seed)
        self.recorder = StreamRecorder(cfg.curve_sample) if cfg.curve_sample > 0 else None
        self.shared: SharedModel | None = None
        for t in cfg.tiers:
            if t.kind == "shared":
                self.shared = SharedModel(t.capacity, t.high_watermark, t.low_watermark, t.touch_interval_s,
                                          t.gc_interval_s, on_event=self._hook("shared", 0), policy=t.policy())
        self.instances: list[_Instance] = []
        for i in range(cfg.instances):
            engine = EngineModel(cfg.engine_blocks, self._hook("engine", i)) if cfg.engine_blocks else None
            tiers: list[tuple[str, object]] = []
            for t in cfg.tiers:
                if t.kind == "shared":
                    tiers.append(("shared", self.shared))
                else:
                    tiers.append((t.kind, LRUModel(t.capacity, self._hook(t.kind, i), t.policy())))
            self.instances.append(_Instance(i, engine, StoreModel(tiers, self.bpt, self._clock, cfg.promote)))
        self.totals = Totals(tier_tokens={t.kind: 0 for t in cfg.tiers}, read_bytes={t.kind: 0 for t in cfg.tiers},
                             read_by_second={t.kind: {} for t in cfg.tiers})
        self.outcomes: list[Outcome] = []
        self.keep_outcomes = keep_outcomes
        # Per request, compact: TTFT with kvtier, without it, full recompute.
        self.ttft, self.ttft_baseline, self.ttft_recompute = array("d"), array("d"), array("d")
        self._fresh = itertools.count(1)
        self._sticky: dict[object, int] = {}
        self._phase = ""
        self.now = 0.0

    def _hook(self, kind: str, inst: int) -> Callable[[int, int], None] | None:
        return self.recorder.hook(kind, inst, self._clock) if self.recorder is not None else None

    # ------------------------------------------------------------ routing
    def route(self, r: Request) -> _Instance:
        n = self.cfg.instances
        if n == 1:
            return self.instances[0]
        if self.cfg.routing == "trace" and r.instance is not None:
            return self.instances[int(r.instance) % n]
        if self.cfg.routing == "sticky" and r.session is not None:
            i = self._sticky.get(r.session)
            if i is None:
                i = self._sticky[r.session] = self.rng.randrange(n)
            return self.instances[i]
        return self.instances[self.rng.randrange(n)]

    def _clock(self) -> float:
        return self.now

    def written_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for inst in self.instances:
            for kind, n in inst.store.written.items():
                out[kind] = out.get(kind, 0) + n
        return out

    def evictions(self) -> dict[str, int]:
        out: dict[str, int] = {"engine": 0}
        for inst in self.instances:
            if inst.engine is not None:
                out["engine"] += inst.engine.evictions
            for kind, m in inst.store.tiers:
                if kind != "shared":
                    out[kind] = out.get(kind, 0) + m.evictions
        if self.shared is not None:
            out["shared"] = self.shared.evictions
        return out

    # ------------------------------------------------------------ one request
    def step(self, r: Request) -> Outcome:
        cfg, bs, k = self.cfg, self.cfg.block_tokens, self.k
        self.now = r.t
        if r.phase != self._phase:
            # A bench log's phases are separated by barriers: the next phase
            # starts on idle engines, whatever backlog the model predicted.
            self._phase = r.phase
            for i in self.instances:
                if i.engine is not None:
                    i.engine.release(float("inf"))  # every request of the last phase has finished
                i.busy = min(i.busy, r.t)
                i.busy_base = min(i.busy_base, r.t)
                i.busy_rc = min(i.busy_rc, r.t)
        inst = self.route(r)
        P, O = r.prompt_tokens, max(r.output_tokens, 1)
        n_prompt = P // bs
        units = list(r.units[:n_prompt])
        while len(units) < n_prompt:  # blocks the trace does not name: content of its own
            units.append(hash((_GAP, next(self._fresh))))
        # Units of generated tokens (and of the prompt's partial tail block).
        n_final = (P + O - 1) // bs
        okey = r.output_key if r.output_key is not None else hash((_FRESH, next(self._fresh)))
        prev = units[-1] if units else 0
        out_units = [hash((prev, okey, P, j)) for j in range(n_final - n_prompt)]
        usable_blocks = min((P - 1) // bs, n_prompt)
        usable = usable_blocks * bs

        # 1. engine prefix cache, as it stands when the instance takes the
        # request (prefills are served one at a time, in arrival order)
        start = max(r.t, inst.busy)
        engine = inst.engine
        if engine is not None:
            engine.release(start)
        local_blocks = engine.match(units, usable_blocks) if engine is not None else 0
        if engine is not None and self.recorder is not None:
            self.recorder.query("engine", inst.idx, units[:usable_blocks], bs, self.now)
        computed = local_blocks * bs

        # 2.-3. kvtier lookup and load
        tier_tokens: dict[str, int] = {}
        load_s = 0.0
        saved_upto = 0
        store = inst.store
        tiers = store.tiers
        if tiers and usable > computed:
            keys = []
            for first in range(0, n_prompt, k):
                end = min(first + k, n_prompt)
                keys.append((hash((units[end - 1], end - first)), (end - first) * bs))
            if self.recorder is not None:
                for kind, _ in tiers:
                    self.recorder.query_keys(kind, inst.idx if kind != "shared" else 0, keys, computed, usable,
                                             self.now)
            hit_tiers = store.lookup(keys)
            hit_keys = keys[: len(hit_tiers)]
            if len(hit_keys) < len(keys):
                start_u = len(hit_keys) * k
                tried = keys[len(hit_keys)][1] // bs
                for n in range(min(k, usable_blocks - start_u), 0, -1):
                    if n == tried:
                        continue
                    key = hash((units[start_u + n - 1], n))
                    h = store.holder(key)
                    if h >= 0:
                        hit_keys.append((key, n * bs))
                        hit_tiers.append(h)
                        break
            hit = sum(nt for _, nt in hit_keys)
            while hit_keys and hit - hit_keys[-1][1] >= usable:
                hit -= hit_keys.pop()[1]
                hit_tiers.pop()
            hit = min(hit, usable)
            saved_upto = sum(1 for _, nt in hit_keys if nt == cfg.chunk_tokens) * cfg.chunk_tokens
            read: dict[str, int] = {}
            if tiers[0][0] == "memory":
                # The load's reads below memory: hit chunks there that end past the engine's own hit.
                wanted, pos = [], 0
                for (key, ntok), h in zip(hit_keys, hit_tiers):
                    pos += ntok
                    if pos > computed and tiers[h][0] != "memory":
                        wanted.append((key, ntok))
                if wanted:
                    _, read = store.fetch(wanted)
            if hit > computed:
                lo, hi, pos = computed, hit, 0
                load_keys = []
                for (key, ntok), h in zip(hit_keys, hit_tiers):
                    a, b = max(pos, lo), min(pos + ntok, hi)
                    if b > a:
                        kind = tiers[h][0]
                        tier_tokens[kind] = tier_tokens.get(kind, 0) + b - a
                        load_keys.append((key, ntok))
                    pos += ntok
                _, read2 = store.fetch(load_keys)
                for kind, nb in read2.items():
                    read[kind] = read.get(kind, 0) + nb
                computed = hit
            for kind, nb in read.items():
                self.totals.read_bytes[kind] += nb
                rb = self.totals.read_by_second[kind]
                sec = int(self.now)
                rb[sec] = rb.get(sec, 0) + nb
            # The request waits for its chunks from the tiers that held them
            # at lookup (read from a lower tier and promoted, or copied from
            # memory), and for the copy into engine blocks.
            for kind, n in tier_tokens.items():
                load_s += self.io[kind].seconds(n * self.bpt)
            if tier_tokens:
                load_s += sum(tier_tokens.values()) * self.bpt / (cfg.copy_gbps * 1e9)

        # 4. saves, step by step as the connector plans them: every full
        # chunk past kvtier's hit as the computed blocks fill it, and once,
        # at the first step that has whole blocks past the last full chunk,
        # those blocks as a shorter chunk (the prompt's tail; if the prompt
        # ends on a chunk boundary, blocks of generated tokens).
        if tiers:
            all_units = units + out_units
            saves: list[tuple[int, int]] = []
            saved, tail = saved_upto // bs, False
            for w in range(n_prompt, n_final + 1):  # whole blocks after prefill, then as decoding fills blocks
                while saved + k <= w:
                    saves.append((hash((all_units[saved + k - 1], k)), cfg.chunk_tokens))
                    saved += k
                if not tail and w > saved:
                    saves.append((hash((all_units[w - 1], w - saved)), (w - saved) * bs))
                    tail = True
            store.put(saves)

        # time
        pf = cfg.prefill
        service = load_s + pf.seconds(P, computed)
        inst.busy = start + service

        # 5. the engine holds the request's blocks until it finishes, then caches its full blocks
        if engine is not None:
            finish = r.t_done if r.t_done is not None else start + service + O * cfg.decode_s_per_token
            engine.run(units[:local_blocks], units + out_units, -(-(P + O) // bs), finish)
        base_service = pf.seconds(P, local_blocks * bs)
        bstart = max(r.t, inst.busy_base)
        inst.busy_base = bstart + base_service
        tot = self.totals
        tot.requests += 1
        tot.prompt_tokens += P
        tot.engine_tokens += local_blocks * bs
        for kind, n in tier_tokens.items():
            tot.tier_tokens[kind] += n
        tot.busy_s += service
        tot.baseline_busy_s += base_service
        recompute = pf.seconds(P, 0)
        rstart = max(r.t, inst.busy_rc)
        inst.busy_rc = rstart + recompute
        tot.recompute_busy_s += recompute
        if tot.t_first is None:
            tot.t_first = r.t
        tot.t_last = max(tot.t_last, r.t)
        out = Outcome(r.t, inst.idx, P, local_blocks * bs, tier_tokens, load_s, start - r.t + service,
                      bstart - r.t + base_service, rstart - r.t + recompute, r.ttft_s, r.cached_tokens, r.phase)
        self.ttft.append(out.ttft_s)
        self.ttft_baseline.append(out.baseline_ttft_s)
        self.ttft_recompute.append(out.recompute_s)
        if self.keep_outcomes:
            self.outcomes.append(out)
        return out

    def run(self, requests: Iterable[Request], tick: Callable[[int], None] | None = None) -> Simulator:
        n = 0
        for r in requests:
            self.step(r)
            n += 1
            if tick is not None and n % 1000 == 0:
                tick(1000)
        if tick is not None:
            tick(n % 1000)
        return self
