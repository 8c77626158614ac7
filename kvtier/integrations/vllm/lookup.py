"""The longest stored prefix of a prompt, as the scheduler asks it.

A prompt's keys are the prefix chain of its chunks (``chain.py``): full
chunks of ``chunk`` tokens, then a shorter chunk of whole blocks where a
stored tail of an earlier, shorter prompt may hold the rest. ``GroupView``
answers for every rank of the TP group: a chunk counts only when every
rank's shard of it is stored.

Threads: ``longest_prefix`` runs on the scheduler's lookup pool (or its own
thread when the answer needs no I/O); the rest on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations.vllm.chain import PromptKeys
from kvtier.integrations.vllm.group import GroupView
from kvtier.keys import ChunkKey


@dataclass(frozen=True)
class Hit:
    tokens: int
    keys: list[ChunkKey]  # keys of the hit chunks (the last may be partial)
    tiers: list[str]  # per hit chunk: the slowest tier holding one of its shards
    sources: list[int] = field(default_factory=list)  # per hit chunk: TP size of its shards (0: ours)

    def tokens_by_tier(self, lo: int, hi: int) -> dict[str, int]:
        """Tokens [lo, hi) of the hit, by the slowest tier holding each chunk."""
        by_tier: dict[str, int] = {}
        pos = 0
        for k, tier in zip(self.keys, self.tiers):
            a, b = max(pos, lo), min(pos + k.num_tokens, hi)
            if b > a:
                by_tier[tier] = by_tier.get(tier, 0) + b - a
            pos += k.num_tokens
        return by_tier


def all_in_memory(view: GroupView, prompt: PromptKeys) -> bool:
    """Whether every chunk of the prompt's whole blocks is in host memory."""
    return bool(view.host_memory) and view.in_host_memory(prompt.keys)


def tiers_in(hit: Hit, lo: int, hi: int) -> list[str]:
    """Tiers of the hit chunks that overlap tokens [lo, hi)."""
    out, pos = [], 0
    for k, tier in zip(hit.keys, hit.tiers):
        if pos + k.num_tokens > lo and pos < hi:
            out.append(tier)
        pos += k.num_tokens
    return out


def longest_prefix(view: GroupView, prompt: PromptKeys, bs: int, usable: int, skip: frozenset[str]) -> Hit:
    """Longest stored prefix of the prompt, in tokens, capped at ``usable``,
    not asking the tiers in ``skip``.

    Full chunks first; where they stop, a shorter chunk (whole blocks)
    may hold the rest: the partial tail an earlier, shorter prompt stored.
    """
    C, keys = prompt.chunk, list(prompt.keys)
    plan = view.lookup(keys, skip)
    hit_keys = keys[: plan.chunks]
    tiers = list(plan.tiers)
    sources = list(plan.sources) or [0] * plan.chunks
    hit = sum(k.num_tokens for k in hit_keys)
    if plan.chunks < len(keys):
        start = plan.chunks * C
        tried = keys[plan.chunks].num_tokens
        for n in range(min(C, usable - start) // bs * bs, 0, -bs):
            if n == tried:
                continue
            k = prompt.shorter(plan.chunks, n)
            sub = view.lookup([k], skip)
            if sub.chunks:
                hit_keys.append(k)
                tiers.append(sub.tiers[0])
                sources.append(sub.sources[0] if sub.sources else 0)
                hit += n
                break
    # Drop chunks that start at or past the usable end; the last one kept
    # may run past it (only its leading blocks are loaded).
    while hit_keys and hit - hit_keys[-1].num_tokens >= usable:
        hit -= hit_keys.pop().num_tokens
        tiers.pop()
        sources.pop()
    return Hit(min(hit, usable), hit_keys, tiers, sources)
