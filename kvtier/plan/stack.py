"""Hit ratio against capacity in one pass: LRU stack distances (Mattson).

An LRU cache that evicts from its cold end only as much as a new object
needs holds, at any moment, the longest run of most recently used objects
that fits. So an object is held in a cache of capacity S exactly when its
*byte stack distance* (its own size plus the sizes of the distinct objects
used since its last use) is at most S: one pass over the access stream gives
the hit ratio at every capacity. (Objects larger than the whole cache break
this; chunks are far smaller than any tier.)

The simulator records, per tier and instance, each object use (a refresh or
an insert) and each lookup (the chunks a request asked for and their
tokens). A chunk's tokens count as a hit at capacity S when its distance at
lookup is at most S. The stream is the one the simulator saw at the
configured capacities: at another capacity the requests' own stores and
promotions would differ a little (the curve is the tier's, with the rest of
the stack as configured).

Only LRU is a stack policy. The shared tier's collector is not (it deletes
in batches down to a watermark, by stamps refreshed at most once a minute):
its curve is computed by replaying its recorded stream through
``SharedModel`` at each capacity of the grid; so is the curve of a memory or
disk tier configured with another eviction policy (``policy_curve``, through
``LRUModel`` under that policy).

Sampling (SHARDS, Waldspurger et al., FAST'15): with ``rate`` < 1 only keys
whose hash falls under the rate are followed and distances are scaled by
1/rate, which keeps curves of million-request traces to seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.plan.models import LRUModel, SharedModel
from kvtier.tiers.eviction import EvictionPolicy

_MASK = 0xFFFFFFFF


@dataclass
class _Stream:
    # One list of events: (key, size) for a use, (key, -tokens - 1) for a
    # lookup; the shared tier adds (key, -1) for a read, and a clock (times).
    keys: list = field(default_factory=list)
    vals: list = field(default_factory=list)
    times: list = field(default_factory=list)
    looked_up: int = 0  # tokens of every lookup, sampled or not


class StreamRecorder:
    """Per (tier, instance): the sampled uses and lookups, in order.

    Keys are already well-mixed 64-bit hashes (chained ``hash`` of int
    tuples), so a key is followed when its low 32 bits fall under the rate."""

    def __init__(self, rate: float = 1.0):
        self.rate = rate
        self._limit = 1 << 32 if rate >= 1.0 else int(rate * (1 << 32))
        self.streams: dict[tuple[str, int], _Stream] = {}

    def sampled(self, key: int) -> bool:
        return (key & _MASK) < self._limit

    def _stream(self, kind: str, inst: int) -> _Stream:
        s = self.streams.get((kind, inst))
        if s is None:
            s = self.streams[(kind, inst)] = _Stream()
        return s

    def hook(self, kind: str, inst: int, clock) -> Callable[[int, int], None]:
        """The ``on_event`` of one tier model: records (key, size) uses."""
        s, limit = self._stream(kind, inst), self._limit
        keys, vals, times = s.keys, s.vals, s.times
        if kind == "shared":  # its collector needs the clock
            def on_event(key: int, size: int) -> None:
                if (key & _MASK) < limit:
                    keys.append(key)
                    vals.append(size)
                    times.append(clock())
        else:
            def on_event(key: int, size: int) -> None:
                if (key & _MASK) < limit:
                    keys.append(key)
                    vals.append(size)
        return on_event

    def query_keys(self, kind: str, inst: int, keys, lo: int, hi: int, now: float) -> None:
        """A kvtier lookup: the tokens of each chunk within [lo, hi) (what the
        engine's own cache missed, up to the last block it must compute)."""
        s = self._stream(kind, inst)
        limit = self._limit
        pos = 0
        for key, ntok in keys:
            if pos >= hi:
                break
            tokens = min(pos + ntok, hi) - max(pos, lo)
            pos += ntok
            if tokens > 0:
                s.looked_up += tokens
                if (key & _MASK) < limit:
                    s.keys.append(key)
                    s.vals.append(-tokens - 1)
                    if kind == "shared":
                        s.times.append(now)

    def query(self, kind: str, inst: int, units, unit_tokens: int, now: float) -> None:
        s = self._stream(kind, inst)
        s.looked_up += len(units) * unit_tokens
        limit = self._limit
        v = -unit_tokens - 1
        for u in units:
            if (u & _MASK) < limit:
                s.keys.append(u)
                s.vals.append(v)


def lookup_distances(keys: list, vals: list) -> tuple[list[float], list[int]]:
    """Byte stack distance of every lookup (inf if never used) and its tokens.

    A Fenwick tree over use positions holds each object's size at its latest
    use; a lookup's distance is the sum from that position to the end."""
    n_uses = sum(1 for v in vals if v >= 0)
    tree = [0] * (n_uses + 1)
    last: dict[int, tuple[int, int]] = {}
    total = 0
    pos = 0
    dists: list[float] = []
    tokens: list[int] = []

    def add(i: int, w: int) -> None:
        while i <= n_uses:
            tree[i] += w
            i += i & -i

    def prefix(i: int) -> int:
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    for key, v in zip(keys, vals):
        if v >= 0:
            old = last.get(key)
            if old is not None:
                add(old[0], -old[1])
                total -= old[1]
            pos += 1
            add(pos, v)
            total += v
            last[key] = (pos, v)
        elif v < -1:
            old = last.get(key)
            dists.append(float("inf") if old is None else total - prefix(old[0] - 1))
            tokens.append(-v - 1)
    return dists, tokens


def lru_curve(streams: list[_Stream], capacities: list[float], rate: float, total_tokens: int) -> list[float]:
    """Tokens held at lookup as a share of ``total_tokens``, per capacity
    (every instance with that capacity).

    With sampling, the share of the sampled lookups' tokens that hit (the
    ratio estimator of SHARDS) is scaled by the exact share of all tokens
    looked up."""
    import numpy as np

    ds, ws = [], []
    for s in streams:
        d, w = lookup_distances(s.keys, s.vals)
        ds += d
        ws += w
    if not ds or not total_tokens:
        return [0.0] * len(capacities)
    d = np.asarray(ds) / rate
    w = np.asarray(ws, dtype=float)
    order = np.argsort(d, kind="stable")
    d, cum = d[order], np.cumsum(w[order])
    looked_up = sum(s.looked_up for s in streams) or float(cum[-1])
    scale = looked_up / float(cum[-1]) / total_tokens
    idx = np.searchsorted(d, np.asarray(capacities, dtype=float), side="right")
    return [float(cum[i - 1]) * scale if i else 0.0 for i in idx]


def lru_replay(keys: list, vals: list, capacity: int) -> int:
    """Brute force: replay one stream through ``LRUModel``; tokens held at lookup."""
    m = LRUModel(capacity)
    held = 0
    for key, v in zip(keys, vals):
        if v >= 0:
            m.store(key, v)
        elif v < -1 and key in m:
            held += -v - 1
    return held


def policy_curve(streams: list[_Stream], capacities: list[int], rate: float, total_tokens: int,
                 policy: Callable[[int], EvictionPolicy]) -> list[float]:
    """Replay each instance's recorded stream through ``LRUModel`` under
    ``policy(capacity)`` at each capacity (scaled by the sampling rate), with
    the same estimator as ``lru_curve``: a memory or disk tier whose policy
    is not LRU."""
    out = []
    for cap in capacities:
        held = sampled = 0
        for s in streams:
            c = max(1, int(cap * rate))
            m = LRUModel(c, policy=policy(c))
            for key, v in zip(s.keys, s.vals):
                if v >= 0:
                    m.store(key, v)
                elif v < -1:
                    sampled += -v - 1
                    if key in m:
                        held += -v - 1
        looked_up = sum(s.looked_up for s in streams) or sampled
        out.append(held / sampled * looked_up / total_tokens if sampled and total_tokens else 0.0)
    return out


def shared_curve(streams: list[_Stream], capacities: list[int], rate: float, total_tokens: int,
                 model_args: dict, policy: Callable[[int], EvictionPolicy] | None = None) -> list[float]:
    """Replay the shared tier's recorded stream at each capacity (scaled by
    the sampling rate), with the same estimator as ``lru_curve``; under
    ``policy(capacity)`` (default: ``SharedModel``'s watermark policy)."""
    out = []
    for cap in capacities:
        held = sampled = 0
        for s in streams:
            c = max(1, int(cap * rate))
            m = SharedModel(c, **model_args, policy=policy(c) if policy is not None else None)
            for key, v, t in zip(s.keys, s.vals, s.times):
                if v >= 0:
                    m.store(key, v, t)
                elif v == -1:
                    m.read(key, t)
                else:
                    sampled += -v - 1
                    if key in m:
                        held += -v - 1
        looked_up = sum(s.looked_up for s in streams) or sampled
        out.append(held / sampled * looked_up / total_tokens if sampled and total_tokens else 0.0)
    return out
