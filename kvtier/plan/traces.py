"""The one request form every trace is normalised to, and block-id arithmetic.

A trace names prompt content by *block ids*: one id per block of
``block_tokens`` tokens (512 in Mooncake's traces, 16 in Bailian's, the
logger's choice in kvtier's own logs). The simulator works on *units* of
``unit_tokens`` tokens, the engine's KV block size (128 for vLLM on CPU, 16
on most GPUs): the engine and kvtier only ever store whole engine blocks.

Unit ids are prefix-chained: unit i's id depends on every block id up to the
block that ends it, so two requests share their first n unit ids exactly when
their traces say they share the first n units of tokens. Traces whose ids are
already prefix-dependent (Mooncake) keep their meaning; traces that hash each
block alone (Bailian's SipHash per block) gain it.

Ids are Python ints mixed with ``hash`` of int tuples, which does not depend on
PYTHONHASHSEED; they are only compared within one run.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

ROOT = 0x6B7674696572  # "kvtier": chain state before the first block


@dataclass(slots=True)
class Request:
    """One request, as the simulator sees it.

    ``units`` are the chained ids of the prompt's whole units (``unit_tokens``
    each); a prompt's last partial unit has none (no engine stores it).
    ``output_key`` identifies the generated tokens: equal keys mean equal
    output (kvtier logs carry the tokens; traces do not, so each request gets
    its own). Measured fields are ``None`` unless the trace is a kvtier log.
    """

    t: float                      # arrival (or send) time, seconds from the trace start
    units: list[int]
    prompt_tokens: int
    output_tokens: int
    session: object = None        # requests of one session share it (routing)
    turn: int = 0
    instance: int | None = None   # the instance the trace says served it
    id: str = ""
    phase: str = ""
    output_key: int | None = None
    t_done: float | None = None   # measured: when it finished (the engine held its blocks until then)
    ttft_s: float | None = None   # measured
    cached_tokens: int | None = None  # measured (vLLM's num_cached_tokens)
    extra: dict = field(default_factory=dict)


@dataclass
class Trace:
    """A re-iterable sequence of requests in arrival order.

    ``open`` returns a fresh iterator each call (big traces are streamed from
    their file, never held in memory); ``count`` is the number of requests
    when known cheaply (for progress bars), else ``None``.
    """

    name: str
    unit_tokens: int
    open: Callable[[], Iterator[Request]]
    count: int | None = None
    meta: dict = field(default_factory=dict)

    def __iter__(self) -> Iterator[Request]:
        return self.open()

    @staticmethod
    def of(name: str, unit_tokens: int, requests: Sequence[Request], **meta) -> Trace:
        reqs = list(requests)
        return Trace(name, unit_tokens, lambda: iter(reqs), len(reqs), dict(meta))


def chain(ids: Iterable[int], salt: int = ROOT) -> list[int]:
    """Prefix-chained ids: out[i] depends on ids[0..i]."""
    out, h = [], salt
    for x in ids:
        h = hash((h, x))
        out.append(h)
    return out


def to_units(hash_ids: Sequence[int], block_tokens: int, input_length: int, unit_tokens: int,
             salt: int = ROOT) -> list[int]:
    """Chained unit ids of a prompt described by per-block ``hash_ids``.

    Only units that are whole and fall in blocks the trace names get an id.
    A block larger than a unit gives each of its units an id of its own
    (``(block chain, index)``); blocks smaller than a unit are grouped, the
    unit's id being the chain through its last block.
    """
    if max(block_tokens, unit_tokens) % min(block_tokens, unit_tokens):
        raise ValueError(f"trace blocks of {block_tokens} tokens and units of {unit_tokens} tokens: "
                         "one must be a multiple of the other")
    n_units = input_length // unit_tokens
    if not hash_ids or not n_units:
        return []
    chained = chain(hash_ids, salt)
    if block_tokens == unit_tokens:
        return chained[:n_units]
    if block_tokens > unit_tokens:
        r = block_tokens // unit_tokens
        n_units = min(n_units, len(chained) * r)
        return [hash((chained[i // r], i % r)) for i in range(n_units)]
    r = unit_tokens // block_tokens
    n_units = min(n_units, len(chained) // r)
    return [chained[(i + 1) * r - 1] for i in range(n_units)]


def expand_tokens(block_id: int, block_tokens: int, vocab: int = 32000, first_id: int = 3) -> list[int]:
    """Deterministic token ids for one trace block: equal ids give equal
    tokens, in every process (BLAKE2b of the id, not ``hash``). Ids below
    ``first_id`` (often special tokens) are never produced."""
    out: list[int] = []
    counter = 0
    span = vocab - first_id
    while len(out) < block_tokens:
        d = hashlib.blake2b(struct.pack("<qQ", block_id, counter), digest_size=64).digest()
        out.extend(first_id + v % span for v in struct.unpack("<16I", d))
        counter += 1
    return out[:block_tokens]


def expand_prompt(hash_ids: Sequence[int], block_tokens: int, input_length: int, vocab: int = 32000) -> list[int]:
    """The prompt's token ids from its trace blocks (for replaying a trace
    against a real engine): block i's tokens depend on the chain through
    block i, so equal prefixes of ids give equal prefixes of tokens."""
    tokens: list[int] = []
    for h in chain(hash_ids):
        tokens.extend(expand_tokens(h, block_tokens, vocab))
        if len(tokens) >= input_length:
            break
    return tokens[:input_length]
