"""The longest stored prefix of a prompt, as the scheduler asks it.

A prompt's keys are the prefix chain of its chunks (``kvtier.keys``): full
chunks of ``chunk`` tokens, then a shorter chunk of whole blocks where a
stored tail of an earlier, shorter prompt may hold the rest. ``GroupView``
answers for every rank of the TP group: a chunk counts only when every
rank's shard of it is stored.

Threads: ``longest_prefix`` runs on the scheduler's lookup pool (or its own
thread when the answer needs no I/O); the rest on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.integrations.vllm.group import GroupView
from kvtier.keys import ChunkKey, next_key


@dataclass(frozen=True)
class Hit:
    tokens: int
    keys: list[ChunkKey]  # keys of the hit chunks (the last may be partial)
    tiers: list[str]  # per hit chunk: the slowest tier holding one of its shards
    sources: list[int] = field(default_factory=list)  # per hit chunk: TP size of its shards (0: ours)



def all_in_memory(view: GroupView, chunk: int, bs: int, root: ChunkKey, tokens: list[int]) -> bool:
    """Whether every chunk of ``tokens``' whole blocks is in host memory."""
    if not view.host_memory:
        return False
    usable_blocks = len(tokens) // bs * bs
    keys, prev = [], root
    for start in range(0, usable_blocks, chunk):
        prev = next_key(prev, tokens[start : min(start + chunk, usable_blocks)])
        keys.append(prev)
    return view.in_host_memory(keys)


def tiers_in(hit: Hit, lo: int, hi: int) -> list[str]:
    """Tiers of the hit chunks that overlap tokens [lo, hi)."""
    out, pos = [], 0
    for k, tier in zip(hit.keys, hit.tiers):
        if pos + k.num_tokens > lo and pos < hi:
            out.append(tier)
        pos += k.num_tokens
    return out


def longest_prefix(view: GroupView, chunk: int, bs: int, root: ChunkKey, tokens: list[int], usable: int,
                   skip: frozenset[str] = frozenset()) -> Hit:
    """Longest stored prefix of ``tokens``, in tokens, capped at ``usable``,
    not asking the tiers in ``skip``.

    Full chunks first; where they stop, a shorter chunk (whole blocks)
    may hold the rest: the partial tail an earlier, shorter prompt stored.
    """
    C = chunk
    keys, prev = [], root
    for start in range(0, len(tokens) // bs * bs, C):
        prev = next_key(prev, tokens[start : min(start + C, len(tokens) // bs * bs)])
        keys.append(prev)
    plan = view.lookup(keys, skip)
    hit_keys = keys[: plan.chunks]
    tiers = list(plan.tiers)
    sources = list(plan.sources) or [0] * plan.chunks
    hit = sum(k.num_tokens for k in hit_keys)
    if plan.chunks < len(keys):
        start = plan.chunks * C
        tried = keys[plan.chunks].num_tokens
        base = hit_keys[-1] if hit_keys else root
        for n in range(min(C, usable - start) // bs * bs, 0, -bs):
            if n == tried:
                continue
            k = next_key(base, tokens[start : start + n])
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
