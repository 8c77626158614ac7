"""``TieredStore`` without bytes: the same lookup, fetch (with promotion) and
put (memory, then write-through to every lower tier), over the policy models
of ``kvtier.plan.models``.

Chunks are ``(key, tokens)`` pairs; an object's size is what the codec would
make of it (``object_bytes``). ``clock`` gives the time stamped on shared
objects (the trace's clock in a simulation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.plan.models import LRUModel, SharedModel

_ALIGN = 4096

Chunk = tuple[int, int]  # (key, tokens)


def object_bytes(tokens: int, bytes_per_token: int) -> int:
    """Size of one chunk object: a 4 KiB header block and the payload padded to 4 KiB (codec.py)."""
    payload = tokens * bytes_per_token
    return _ALIGN + -(-payload // _ALIGN) * _ALIGN


class StoreModel:
    def __init__(self, tiers: Sequence[tuple[str, LRUModel | SharedModel]], bytes_per_token: int,
                 clock: Callable[[], float], promote: bool = True):
        self.tiers = list(tiers)  # (kind, model), fastest first
        self.bpt = bytes_per_token
        self.clock = clock
        self.promote = promote
        self.memory = self.tiers[0][1] if self.tiers and self.tiers[0][0] == "memory" else None
        self.written: dict[str, int] = {k: 0 for k, _ in self.tiers}

    def size(self, tokens: int) -> int:
        return object_bytes(tokens, self.bpt)

    def holder(self, key: int) -> int:
        """Index of the fastest tier holding ``key``, or -1."""
        for i, (_, m) in enumerate(self.tiers):
            if key in m:
                return i
        return -1

    def lookup(self, chunks: Sequence[Chunk]) -> list[int]:
        """The serving tier of each leading chunk held anywhere
        (``TieredStore.lookup``): at each position the fastest tier holding
        the chunk there serves the whole run it holds from there, even where
        a faster tier holds some of that run too."""
        out: list[int] = []
        pos, n = 0, len(chunks)
        while pos < n:
            for i, (_, m) in enumerate(self.tiers):
                run = 0
                while pos + run < n and chunks[pos + run][0] in m:
                    run += 1
                if run:
                    out += [i] * run
                    pos += run
                    break
            else:
                break
        return out

    def fetch(self, chunks: Sequence[Chunk]) -> tuple[int, dict[str, int]]:
        """``TieredStore.fetch`` of the leading chunks: chunks served and bytes
        read per tier. Reads of the lower tiers start at once (their LRU
        positions and stamps refresh first); the objects are then handed over
        in key order, memory entries refreshed, the others promoted."""
        plan = self.lookup(chunks)
        read: dict[str, int] = {}
        now = self.clock()
        for (key, ntok), h in zip(chunks, plan):
            kind, m = self.tiers[h]
            if kind == "memory":
                continue
            read[kind] = read.get(kind, 0) + self.size(ntok)
            if kind == "shared":
                m.read(key, now)
            else:
                m.touch(key)
        served = 0
        for (key, ntok), h in zip(chunks, plan):
            kind, m = self.tiers[h]
            if kind == "memory":
                if not m.touch(key):
                    break  # evicted by a promotion of this very fetch
                read["memory"] = read.get("memory", 0) + self.size(ntok)
            elif self.memory is not None and self.promote:
                self.memory.store(key, self.size(ntok))
            served += 1
        return served, read

    def put(self, chunks: Sequence[Chunk]) -> None:
        """``TieredStore.put``: into memory, then written through to each lower tier."""
        now = self.clock()
        for kind, m in self.tiers:
            shared = kind == "shared"
            for key, ntok in chunks:
                size = self.size(ntok)
                new = key not in m
                if shared:
                    m.store(key, size, now)
                elif not m.store(key, size):
                    break  # a tier's store stops at its first refusal (nothing behind a gap)
                if new:
                    self.written[kind] += size
