"""What the scheduler side keeps per request, from its first lookup until
vLLM reports it finished.

Threads: the scheduler thread only (a lookup's future completes on the
lookup pool; its answer is read here once done).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.integrations.vllm.chain import KeyChain
from kvtier.integrations.vllm.lookup import Hit


@dataclass
class RequestState:
    request: Any
    keys: KeyChain
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

    @property
    def loading_async(self) -> bool:
        """An asynchronous load of it is in flight (claimed, not reported done)."""
        return self.loading_blocks is not None and not self.sync_load


def done_hit(st: RequestState | None) -> Hit | None:
    """The request's finished lookup answer; None while it runs, or if it
    failed (a failed lookup is a miss, never a failed request)."""
    if st is None or st.lookup is None or not st.lookup.done() or st.lookup.cancelled():
        return None
    if st.lookup.exception() is not None:
        return None
    return st.lookup.result()
