"""What the scheduler learns of its tiers' read rates, for the cost model
(costs.py).

The loads themselves teach it (the workers' read times, ``measured``).
Where no load does, a probe reads one chunk on a thread of this object's
own, so that no request waits on a tier being measured:

- a calibration: a fresh engine knows no tier's rate; after a save, each
  persistent tier not measured yet reads back the chunk just saved, once
  the write-through stored it (``calibrate``);
- a re-measure: a tier ruled out (slower than prefill) is not asked by
  lookups; once due, one lookup's first chunk is read from it instead
  (``remeasure``).

Threads: the scheduler thread calls every method; the probes run on the
probe pool (``_read_back`` and ``GroupView.probe``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from kvtier.config import StoreConfig
from kvtier.concurrency.executor import LOAD, PriorityExecutor
from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.group import GroupView
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.settings import LoadDecision
from kvtier.keys import ChunkKey

log = logging.getLogger(__name__)

# How often a read-back probe looks for the chunk a save is writing.
_READ_BACK_POLL_S = 0.1


class TierProbes:
    def __init__(self, view: GroupView, costs: LoadCosts, metrics: ConnectorMetrics, store: StoreConfig,
                 decision: LoadDecision, persistent: frozenset[str]):
        """``persistent``: the tiers that do I/O (the others are host memory)."""
        self.view = view
        self.costs = costs
        self.metrics = metrics
        self.store = store
        self.decision = decision
        self.persistent = persistent
        self._prober = PriorityExecutor("vllm-probe", 1)  # apart from lookups
        self.running: list[tuple[str, Future]] = []  # probes not yet collected: (tier, its future)

    def remeasure(self, tier: str, key: ChunkKey) -> None:
        """Read chunk ``key`` from ``tier``, ruled out, to measure it again,
        if the tier holds it."""
        self.running.append((tier, self._prober.submit(
            LOAD, self.view.probe, tier, key, self.store.lookup_timeout_s, self.store.load_timeout_s)))

    def calibrate(self, key: ChunkKey) -> None:
        """Measure each persistent tier whose rate is not known on ``key``,
        a chunk just saved, once it is stored there: in the background, so
        that the resumes after this prefill know what loading costs."""
        if self.decision.mode != "auto":
            return
        for tier in sorted(self.persistent):
            if self.costs.start_calibration(tier):
                self.running.append((tier, self._prober.submit(LOAD, self._read_back, tier, key)))

    def _read_back(self, tier: str, key: ChunkKey) -> tuple[float, int] | None:
        """Probe ``tier`` with ``key`` once the save reached it (probe
        thread): the write-through is asynchronous, so look until it is
        there, for as long as a probe may take."""
        deadline = time.monotonic() + self.decision.probe_interval_s
        while True:
            got = self.view.probe(tier, key, self.store.lookup_timeout_s, self.store.load_timeout_s)
            if got is not None or time.monotonic() > deadline:
                return got
            time.sleep(_READ_BACK_POLL_S)

    def collect(self) -> None:
        """Feed finished probes to the cost model."""
        done = [(t, f) for t, f in self.running if f.done()]
        if not done:
            return
        self.running = [(t, f) for t, f in self.running if not f.done()]
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
            self.measured(tier, seconds, max(tokens, 1))

    def measured(self, tier: str, seconds: float, tokens: int) -> None:
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

    def close(self) -> None:
        self._prober.close(cancel_pending=True)
