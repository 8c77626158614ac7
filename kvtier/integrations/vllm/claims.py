"""How much of a hit the scheduler claims, and how many finished loads the
engine takes per step: the cost model (costs.py) applied to the requests
the scheduler keeps, under ``load_decision: auto``.

A hit is claimed only as far as loading it, behind the loads already
queued on its tier and beside the prompts the engine has yet to compute,
beats recomputing it. Decided once per lookup answer and vLLM hit, so that
vLLM's repeated asks get one answer.

Threads: the scheduler thread only.
"""

from __future__ import annotations

from typing import Iterable

from kvtier.integrations.vllm.costs import LoadCosts
from kvtier.integrations.vllm.lookup import Hit
from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.integrations.vllm.state import RequestState


class Claims:
    def __init__(self, costs: LoadCosts, metrics: ConnectorMetrics, block_size: int, mode: str):
        """``mode``: ``load_decision`` (``always`` claims every hit, whole)."""
        self.costs = costs
        self.metrics = metrics
        self.bs = block_size
        self.mode = mode

    def end(self, st: RequestState, hit: Hit, lo: int, reqs: Iterable[RequestState]) -> int:
        """Where the claimed part of ``hit`` ends (tokens): all of it, or up
        to the first chunk past vLLM's own hit ``lo`` whose tier loads slower
        than the engine recomputes, behind the loads queued there (``reqs``:
        every request the scheduler keeps). A cut is counted."""
        if hit.tokens <= lo or self.mode == "always":
            return hit.tokens
        if st.claim is not None and st.claim[0] is st.lookup and st.claim[1] == lo:
            return st.claim[2]
        reqs = list(reqs)
        starts, pos = [], 0
        for k in hit.keys:
            starts.append(pos)
            pos += k.num_tokens
        first = next(i for i, k in enumerate(hit.keys) if starts[i] + k.num_tokens > lo)
        tokens = [min(starts[i] + k.num_tokens, hit.tokens) - max(starts[i], lo)
                  for i, k in enumerate(hit.keys) if i >= first]
        ahead = self._queued_tokens(reqs)
        waiting = sum(1 for other in reqs if other.loading_async)
        n, stopped = self.costs.claimable(hit.tiers[first:], tokens, ahead, _engine_backlog(reqs, st), waiting)
        end = hit.tokens if first + n >= len(hit.keys) else max(lo, starts[first + n])
        if stopped is not None and end < hit.tokens:
            reason = "queued" if ahead.get(stopped) and self.costs.pays_off(stopped) else "cut"
            self.metrics.recompute_decisions.labels(stopped, reason).inc()
            self.metrics.recomputed_hit_tokens.labels(stopped).inc(hit.tokens - end)
        st.claim = (st.lookup, lo, end)
        return end

    def release(self, reqs: Iterable[RequestState]) -> int:
        """How many finished loads the workers may hand to the engine this
        step (0: all): one while two or more loads are in flight and the
        engine would take longer to compute their suffixes than a step's
        fixed cost (``LoadCosts.pace_loads``)."""
        if self.mode != "auto":
            return 0
        suffixes = sorted(st.request.num_tokens - st.claim[2] for st in reqs
                          if st.loading_async and st.claim is not None)
        if len(suffixes) < 2:
            return 0
        return 1 if self.costs.pace_loads(suffixes[len(suffixes) // 2]) else 0

    def _queued_tokens(self, reqs: list[RequestState]) -> dict[str, int]:
        """Per tier, tokens of the asynchronous loads claimed there and not
        reported done: a new load from the tier waits behind them."""
        out: dict[str, int] = {}
        for st in reqs:
            if st.loading_async:
                out[st.load_tier] = out.get(st.load_tier, 0) + len(st.loading_blocks) * self.bs
        return out


def _engine_backlog(reqs: list[RequestState], mine: RequestState) -> int:
    """Prompt tokens the engine has yet to compute for the requests
    answered before ``mine`` and not loading: the queue a recomputed
    request would wait behind (a loaded one reads meanwhile)."""
    out = 0
    for st in reqs:
        if st is mine or not st.answered or st.loading_blocks is not None:
            continue
        req = st.request
        out += max(0, getattr(req, "num_prompt_tokens", 0) - getattr(req, "num_computed_tokens", 0))
    return out
