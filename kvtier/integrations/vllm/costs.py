"""Load or recompute: claim only the part of a hit whose load pays off.

A hit on a persistent tier costs its read; recomputing the same tokens
costs prefill. On healthy storage the read is many times cheaper, but a
throttled or overloaded shared mount, or a remote tier across a slow link,
can read slower than the engine computes, and then a hit would make the
request slower than no cache at all. ``LoadCosts`` keeps both rates, as
seconds per token, from what the engine itself does:

- **prefill**: each engine step's wall time over the tokens it scheduled
  (steps of at least a chunk of tokens: prefill work, not decode), an
  exponentially weighted mean; seeded by ``prefill_tokens_per_s``. A step
  runs from when the scheduler built it (or, when vLLM schedules ahead,
  from the end of the step before it) to when its output came back, so
  the engine's idle time between requests never counts as prefill. Each
  output is matched to its step by the number the workers send back, and
  the engine's first forward (one-time costs) is not counted;
- **each tier's load**: the workers' own read time of every finished
  asynchronous load (reported through vLLM's worker metadata, the slowest
  rank's), over the tokens it loaded, charged to the slowest tier it read
  from; seeded by the tier's ``expected_read_rate`` (bytes per second).
  The read time is the load's *share* of the time the worker spent
  reading: while n loads read at once each is charged 1/n of that time
  (worker.py). The rate is thus the tier's time per token when it serves
  one load alone, whatever the loader's concurrency was while measuring.

``claimable`` cuts a hit before its first chunk whose tier loads slower
than prefill computes; chunks in host memory always pay off (a memcpy).
It also sees the queue: a new load starts behind the loads in flight or
pending on its tier (the worker's loader reads `load_threads` loads, one
by default, at a time, in submission order, sharing the tier's bandwidth), so it ends
after about (tokens ahead, not yet done, + its own) x the tier's rate.
Because that rate is a one-load-alone rate, the sum counts the queue
once: a rate measured as wall time per token under the loader's
concurrency would count the sharing twice (in the rate, and again in the
tokens ahead). A tier's chunks are claimed only if that finish beats
recomputing them behind the engine's backlog (the prompt tokens it has
yet to compute for requests ahead that are not loading): a load runs
while the engine works through that backlog, and the request then
computes only its suffix, whereas a recompute waits for the backlog and
then computes its own tokens too.

A rate not known is measured before any request depends on it where it
can be: once the engine saved a chunk, the scheduler reads it back from
each persistent tier whose rate is unknown, in the background
(``start_calibration``), so that the resumes after an engine's first
prefills know what their tiers cost. Until then a rate not known is
trusted; every load is bounded instead (``budget``): the worker stops reading at the budget,
keeps the chunks that arrived and reports the rest failed, and vLLM
recomputes it. A load stopped before anything arrived teaches the rate
of one token in all that time, so the tier is ruled out at once. A tier
ruled out is left out of lookups and re-measured ``probe_interval_s``
after its last measurement: the scheduler looks up and reads one chunk of
it in the background (no request waits on it), so that a tier that
recovered is used again.

Threads: the scheduler thread calls everything here.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

# Weight of the newest measurement in a rate's running mean: a handful of
# loads moves it (a tier that slowed down is noticed within a few requests).
_ALPHA = 0.3

# A load's budget never exceeds this fraction of recomputing its tokens
# beyond the load's expected time. A stopped load costs its request at most
# the budget plus recomputing what did not arrive, so a load that delivers
# nothing costs 1.1 x recompute; the rest of ~1.15 x is left for noticing
# the stop (one engine step, or 5 ms while the engine idles) and for the
# step that schedules the request again.
CUT_FRACTION = 0.1
# A healthy load may take this multiple of its expected time for each load
# it may share the tier with (the worker's load_threads): reads jitter.
HEALTHY_MULTIPLE = 2.0


# Steps of at most this many tokens are decode work: their time is the
# engine's fixed cost of a step (``pace_loads``).
DECODE_STEP_TOKENS = 16
# Loads are paced when a loaded request's own compute exceeds this many
# steps' fixed cost (``pace_loads``).
PACE_MARGIN = 2.0


@dataclass
class Rate:
    """Seconds per token, a running mean of measurements (None: unknown)."""

    value: float | None = None
    when: float = -math.inf  # monotonic time of the last measurement

    def observe(self, seconds: float, tokens: int, now: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        x = seconds / tokens
        self.value = x if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * x
        self.when = now


@dataclass
class LoadCosts:
    memory_tiers: frozenset[str]  # host memory: always worth loading
    min_step_tokens: int  # steps with fewer scheduled tokens say nothing about prefill
    probe_interval_s: float = 30.0
    sharing: int = 1  # loads a worker reads at once (load_threads): a load may share the tier with as many
    prefill: Rate = field(default_factory=Rate)
    step: Rate = field(default_factory=Rate)  # seconds of a step of decode work (per step, not per token)
    tiers: dict[str, Rate] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    # Steps scheduled whose output has not come back: (number, when built, tokens).
    _steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    _numbered: int = 0  # the last step's number
    _warm: bool = False  # the engine ran its first forward
    _last_done: float = -math.inf  # when the last step's output came back
    _probing: dict[str, float] = field(default_factory=dict)  # tier -> when a probe of it was claimed

    @classmethod
    def seeded(cls, memory_tiers: Iterable[str], min_step_tokens: int, prefill_tokens_per_s: float | None,
               tier_seconds_per_token: dict[str, float], probe_interval_s: float = 30.0,
               sharing: int = 1) -> "LoadCosts":
        costs = cls(frozenset(memory_tiers), min_step_tokens, probe_interval_s, max(1, sharing))
        if prefill_tokens_per_s:
            costs.prefill.value = 1.0 / prefill_tokens_per_s
        for tier, spt in tier_seconds_per_token.items():
            costs.tiers[tier] = Rate(spt, costs.clock())  # as if measured at start: probed only later
        return costs

    # ------------------------------------------------------------ measuring
    def step_scheduled(self, scheduled_tokens: int) -> int:
        """The scheduler built a step of ``scheduled_tokens``; its number,
        which the workers send back with the step's output."""
        self._numbered += 1
        self._steps.append((self._numbered, self.clock(), scheduled_tokens))
        return self._numbered

    def step_done(self, number: int | None = None) -> None:
        """The output of step ``number`` came back from the workers.

        Steps are matched by number, not taken in order: vLLM hands the
        connector no output at all for a step that ran no forward and had
        nothing to report, and pairing outputs with steps in order would
        then time each step by the one after it (a prefill step read as a
        decode step). Steps older than ``number`` that never reported are
        dropped unmeasured. ``None`` (workers that send no number): the
        oldest step."""
        if not self._steps:
            return
        now = self.clock()
        if number is not None:
            while self._steps and self._steps[0][0] < number:
                self._steps.popleft()
            if not self._steps or self._steps[0][0] != number:
                return
        _, built, tokens = self._steps.popleft()
        start, self._last_done = max(built, self._last_done), now
        if tokens > 0 and not self._warm:
            # The engine's first forward pays its one-time costs (kernels
            # built, memory first touched): a tiny model's first 600-token
            # step took 1.9 s where the next 256 took 10 ms.
            self._warm = True
            return
        if tokens >= self.min_step_tokens:
            self.prefill.observe(now - start, tokens, now)
        elif 0 < tokens <= DECODE_STEP_TOKENS:
            self.step.observe(now - start, 1, now)

    def loaded(self, tier: str, seconds: float, tokens: int) -> None:
        """A load from ``tier`` (its slowest) read ``tokens`` in ``seconds``."""
        self._probing.pop(tier, None)
        if tier in self.memory_tiers:
            return
        self.tiers.setdefault(tier, Rate()).observe(seconds, tokens, self.clock())

    def load_ended(self, tier: str) -> None:
        """A load from ``tier`` ended without a timing (failed). A probe that
        found nothing to read does not call this: it lapses on its own."""
        self._probing.pop(tier, None)

    # ------------------------------------------------------------ deciding
    def pays_off(self, tier: str) -> bool:
        """Is loading from ``tier`` no slower than recomputing, as far as known?"""
        if tier in self.memory_tiers:
            return True
        load, prefill = self.tiers.get(tier), self.prefill.value
        return load is None or load.value is None or prefill is None or load.value <= prefill

    def ruled_out(self) -> frozenset[str]:
        """Tiers not worth asking: slower than prefill. A lookup there would
        only wait on a slow server (a stat queues behind its reads) for a hit
        kvtier would not claim; ``start_probe`` re-measures them instead."""
        return frozenset(t for t in self.tiers if not self.pays_off(t))

    def _probe_due(self, tier: str, now: float) -> bool:
        probe = self._probing.get(tier)
        return (now - self.tiers[tier].when >= self.probe_interval_s
                and (probe is None or now - probe >= self.probe_interval_s))

    def claimable(self, tiers: list[str], tokens: list[int], ahead: Mapping[str, int], engine: int,
                  waiting: int) -> tuple[int, str | None]:
        """How many leading chunks of a hit (``tiers``: each chunk's slowest
        tier; ``tokens``: each chunk's tokens to load) to claim, and the tier
        that stopped the claim short (None: all of it). ``ahead``: per tier,
        tokens of the loads in flight or pending there, not yet done;
        ``engine`` and ``waiting``: as ``_queue_pays_off`` takes them."""
        n, stopped = len(tiers), None
        for i, tier in enumerate(tiers):
            if not self.pays_off(tier):
                n, stopped = i, tier
                break
        if not ahead:
            return n, stopped
        # Per tier, the queue ahead is a fixed wait that more tokens of the
        # request amortize: judge each tier on all its chunks of the claim,
        # and cut before the first chunk of a tier that does not pay off
        # (which shortens the claim on later tiers: judge those again).
        while True:
            own: dict[str, int] = {}
            for tier, k in zip(tiers[:n], tokens[:n]):
                own[tier] = own.get(tier, 0) + k
            late = next((i for i, tier in enumerate(tiers[:n])
                         if not self._queue_pays_off(tier, own[tier], ahead.get(tier, 0), engine, waiting)), None)
            if late is None:
                return n, stopped
            n, stopped = late, tiers[late]

    def _queue_pays_off(self, tier: str, own: int, ahead: int, engine: int, waiting: int) -> bool:
        """Does loading ``own`` tokens from ``tier`` behind ``ahead`` tokens
        cost less than recomputing them, behind the ``engine`` tokens the
        engine has yet to prefill for requests ahead, with ``waiting``
        loaded requests that need the engine for their suffixes?

        The load runs while the engine computes that backlog; the request
        then computes only its suffix. Recomputed, it waits for the backlog
        and computes its own tokens as well, and while it does, every
        request whose load ends meanwhile waits for the engine too: a
        recompute in a burst costs the others as much as it costs itself.
        So the load pays off when it ends before the backlog and the
        recompute would, counting that recompute once per request it holds
        up. Between requests of about one size this is the tier's rate
        against prefill again; it cuts a small request from waiting behind
        large loads."""
        if tier in self.memory_tiers or not ahead:
            return True
        load, prefill = self.tiers.get(tier), self.prefill.value
        if load is None or load.value is None or prefill is None:
            return True
        return (ahead + own) * load.value <= (engine + own * (1 + waiting)) * prefill

    def budget(self, tier: str, tokens: int) -> float | None:
        """Seconds a load of ``tokens`` from ``tier`` (its slowest) may read,
        from when its reads start: ``HEALTHY_MULTIPLE`` x its expected time
        for each load it may share the tier with (``sharing``)
        at the tier's known rate, but never more than ``CUT_FRACTION`` of
        recomputing the tokens beyond the expected time, and never less than
        that fraction (a rate not known yet expects nothing). None while
        the prefill rate is unknown: nothing to compare with."""
        prefill = self.prefill.value
        if prefill is None or tokens <= 0:
            return None
        rate = None if tier in self.memory_tiers else self.tiers.get(tier)
        expected = tokens * rate.value if rate is not None and rate.value is not None else 0.0
        allowance = CUT_FRACTION * tokens * prefill
        return max(allowance, min(HEALTHY_MULTIPLE * self.sharing * expected, expected + allowance))

    def pace_loads(self, suffix_tokens: int) -> bool:
        """Whether to hand loaded requests to the engine one per step rather
        than all at once, when each must still compute ``suffix_tokens``.

        The engine computes every request handed to it in one step and all
        their first tokens come at that step's end: with c loads ending
        together, every one of them waits for c suffixes. One per step, the
        k-th waits for k suffixes and a step's fixed cost each: the median
        halves and the last is no later, as long as a suffix costs more than
        a step's fixed cost (an engine whose step time grows with its
        tokens, as on CPUs). The last one pays a step's fixed cost per
        request before it, so pacing waits for a suffix to cost
        ``PACE_MARGIN`` steps: the median then falls by a third or more and
        the last rises by at most half a suffix's share. Where a step's
        fixed cost dominates (GPUs: computing eight suffixes together costs
        about what one does), all at once is better, and stays."""
        prefill, step = self.prefill.value, self.step.value
        return prefill is not None and step is not None and suffix_tokens * prefill > PACE_MARGIN * step

    def measured(self, tier: str) -> bool:
        """Whether ``tier``'s load rate is known (host memory needs none)."""
        rate = self.tiers.get(tier)
        return tier in self.memory_tiers or (rate is not None and rate.value is not None)

    def start_calibration(self, tier: str) -> bool:
        """Whether to measure ``tier``, whose rate is not known, now: one
        probe at a time (one that never reports lapses after
        ``probe_interval_s``). True marks it started."""
        now = self.clock()
        if self.measured(tier):
            return False
        probe = self._probing.get(tier)
        if probe is not None and now - probe < self.probe_interval_s:
            return False
        self._probing[tier] = now
        return True

    def start_probe(self, tier: str) -> bool:
        """Whether to re-measure ``tier`` now (one probe at a time, each
        ``probe_interval_s`` after the last measurement; a probe that never
        reports lapses after as long). True marks it started."""
        now = self.clock()
        if tier not in self.tiers or not self._probe_due(tier, now):
            return False
        self._probing[tier] = now
        return True
