"""The chunk keys of a request's tokens: the one place the scheduler side
makes them.

A request's keys are a prefix chain (``kvtier.keys``) rooted at the TP
group's namespace with the request's tenant salt: full chunks of ``chunk``
tokens, each following the one before, and where they stop at most one
shorter chunk of whole blocks: the tail of a prompt, saved when its prefill
ends, or, in a lookup, a tail an earlier and shorter prompt stored. The
workers name their own shard of each key (``Topology.shard``).

A request's tokens only grow, so the keys of its full chunks are made once
and kept: its lookups and its saves share them.

Threads: the scheduler thread owns ``KeyChains`` and every ``KeyChain``. A
``PromptKeys`` is complete when made and only read afterwards, so a lookup
runs on it on the scheduler's lookup pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvtier.keys import ChunkKey, Namespace, next_key, root_key


class KeyChains:
    """The chains of one namespace: a root per tenant salt, made once."""

    def __init__(self, namespace: Namespace, chunk: int):
        self.namespace = namespace
        self.chunk = chunk
        self._roots: dict[str, ChunkKey] = {}

    def chain(self, salt: str | None) -> "KeyChain":
        """A new request's chain, under its tenant ``salt`` (None: none)."""
        salt = salt or ""
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(self.namespace.with_salt(salt).digest())
        return KeyChain(root, self.chunk)


class KeyChain:
    """One request's keys; ``tokens`` are always the request's own, as far
    as vLLM knows them."""

    def __init__(self, root: ChunkKey, chunk: int):
        self.root = root
        self.chunk = chunk
        self._full: list[ChunkKey] = []  # the keys of the leading full chunks made so far

    def full(self, index: int, tokens: Sequence[int]) -> ChunkKey:
        """Key of full chunk ``index`` (tokens [index*C, (index+1)*C))."""
        C = self.chunk
        while len(self._full) <= index:
            i = len(self._full)
            prev = self._full[-1] if self._full else self.root
            self._full.append(next_key(prev, list(tokens[i * C : (i + 1) * C])))
        return self._full[index]

    def tail(self, tokens: Sequence[int], start: int, end: int) -> ChunkKey:
        """Key of the shorter chunk ``tokens[start:end]``, which follows the
        full chunks before ``start`` (a chunk boundary)."""
        i = start // self.chunk
        prev = self.full(i - 1, tokens) if i else self.root
        return next_key(prev, list(tokens[start:end]))

    def prompt(self, tokens: list[int], end: int) -> "PromptKeys":
        """The keys of ``tokens[:end]`` chunk by chunk (``end`` a block
        boundary; the last chunk may be shorter), for a lookup."""
        C = self.chunk
        keys = [self.full(i, tokens) for i in range(end // C)]
        if end % C:
            keys.append(self.tail(tokens, end - end % C, end))
        return PromptKeys(self.root, C, tokens, tuple(keys))


@dataclass(frozen=True)
class PromptKeys:
    """The keys of a prompt's whole blocks, as a lookup asks for them."""

    root: ChunkKey
    chunk: int
    tokens: list[int]  # the prompt's tokens (read only)
    keys: tuple[ChunkKey, ...]  # full chunks, the last one possibly shorter

    def shorter(self, index: int, n: int) -> ChunkKey:
        """Key of the first ``n`` tokens of chunk ``index`` (every chunk
        before it full): a tail a shorter prompt may have stored there."""
        prev = self.keys[index - 1] if index else self.root
        start = index * self.chunk
        return next_key(prev, self.tokens[start : start + n])
