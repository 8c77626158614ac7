"""Which instance holds which KV block, where, and how much of a prompt each
could serve from it.

    index = PrefixIndex(instances=3)                 # one shared tier read by all
    index.apply(0, batch.events)                      # vLLM KV events of instance 0
    index.predict(tokens, salt=None) -> [Prediction per instance]

The index never computes a block hash: vLLM's hashes depend on a seed the
router does not know (and differ between engines started without a fixed
``PYTHONHASHSEED``). Each ``BlockStored`` names a block's parent hash, its
tokens and its extra keys (the tenant's ``cache_salt`` on a prompt's first
block), so per instance the index keeps a tree: parent hash -> the children
seen under it, keyed by (their tokens, their extra keys). A prompt is
matched from the root (parent ``None``) block by block, by content alone.

Per block, an instance holds a set of ``Holding``s (medium, locality,
ownership): vLLM's GPU blocks (medium ``GPU``, or ``None`` on some
releases), kvtier's tiers (``CPU`` for host memory, ``STORAGE`` for disk
and shared tiers; ``REMOTE`` locality for a shared tier, ownership the
tier's name). A block one instance reports ``REMOTE`` is readable by every
instance that reads the same shared tier (``shared``: groups of instances,
one group of all by default), and a ``REMOTE`` removal any of them reports
removes it for all; every other holding belongs to its own instance.

Only the prompt's own content and salt are matched: blocks published with
other extra keys (a LoRA adapter's name, multimodal features) never match,
and events of KV cache groups other than the first (``group_idx`` > 0,
hybrid models) are counted as ignored.

Thread ownership: every public method takes the index's lock; subscribers'
threads call ``apply``, the router's thread ``predict``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError

# Speed classes, fastest first: the router prefers a hit held in a faster one.
CLASSES = ("GPU", "CPU", "STORAGE-LOCAL", "STORAGE-REMOTE")
_LOCAL_CLASS = {"GPU": 0, "CPU": 1, "STORAGE": 2}

BlockHash = bytes | int
# A child's key under its parent: (its token ids, its extra keys or None).
BlockKey = tuple[tuple[int, ...], tuple | None]


@dataclass(frozen=True)
class Holding:
    """One copy of a block: on which medium, how reachable, in which tier."""

    medium: str            # GPU, CPU, STORAGE (None in an event: GPU)
    locality: str          # LOCAL or REMOTE (None in an event: LOCAL)
    ownership: str | None  # the kvtier tier's name, None for vLLM's own

    @property
    def speed(self) -> int:
        """Index into ``CLASSES``; anything REMOTE, or a medium this index
        does not know, ranks with the slowest."""
        return 3 if self.locality == "REMOTE" else _LOCAL_CLASS.get(self.medium, 3)


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of a prompt, held as ``holding`` by ``source``."""

    start: int
    end: int
    holding: Holding
    source: int  # the instance whose events reported the holding


@dataclass(frozen=True)
class Prediction:
    """One instance's predicted prefix hit for one prompt."""

    tokens: int                        # matched leading tokens
    segments: tuple[Segment, ...] = ()  # consecutive, from token 0 to ``tokens``

    def by_class(self) -> tuple[int, ...]:
        """Matched tokens per speed class, in ``CLASSES`` order."""
        out = [0] * len(CLASSES)
        for s in self.segments:
            out[s.holding.speed] += s.end - s.start
        return tuple(out)


@dataclass
class _Node:
    parent: BlockHash | None
    key: BlockKey
    holdings: set[Holding] = field(default_factory=set)


@dataclass
class _Graph:
    """One instance's blocks. ``children[parent][n_tokens][key] = hash``."""

    nodes: dict[BlockHash, _Node] = field(default_factory=dict)
    children: dict[BlockHash | None, dict[int, dict[BlockKey, BlockHash]]] = field(default_factory=dict)


def _frozen(value: Any) -> Any:
    """Lists (msgpack's arrays) as tuples, so that extra keys are hashable."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def extra_key(extra: Any) -> tuple | None:
    """An event's extra keys for one block, as the index keys them."""
    return _frozen(extra) if extra else None


def prompt_extra(start: int, salt: str | None) -> tuple | None:
    """The extra keys vLLM gives the block of a plain prompt that starts at
    token ``start``: the cache salt on the first block only."""
    return (salt,) if salt and start == 0 else None


class PrefixIndex:
    """Blocks per instance, their holdings, and prefix predictions over them."""

    def __init__(self, instances: int, shared: Sequence[Collection[int]] | None = None):
        if instances < 1:
            raise ConfigError("instances", f"must be at least 1, got {instances}", "give one events stream per server")
        groups = [set(range(instances))] if shared is None else [set(g) for g in shared]
        for g in groups:
            bad = sorted(k for k in g if not 0 <= k < instances)
            if bad:
                raise ConfigError("shared", f"instance {bad[0]} is not one of 0..{instances - 1}",
                                  "name instances by their index in the list of servers")
        self.instances = instances
        # readers[j]: the other instances that can read what j reports REMOTE.
        self._readers = [set().union(*(g for g in groups if j in g)) - {j} for j in range(instances)]
        self._graphs = [_Graph() for _ in range(instances)]
        self._lock = threading.Lock()
        self.ignored = [0] * instances    # events of other KV cache groups
        self.malformed = [0] * instances  # BlockStored whose tokens do not cut into its blocks

    # ------------------------------------------------------------ events

    def apply(self, instance: int, events: Iterable[Any]) -> None:
        """Apply one batch's events (vLLM's ``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``, by class name) reported by ``instance``."""
        with self._lock:
            for ev in events:
                handler = _HANDLERS.get(type(ev).__name__)
                if handler is None or (getattr(ev, "group_idx", None) or 0) != 0:
                    self.ignored[instance] += 1
                elif not handler(self, instance, ev):
                    self.malformed[instance] += 1

    def clear_gpu(self, instance: int) -> None:
        """Forget ``instance``'s GPU holdings (its engine restarted or reset
        its prefix cache); what its tiers reported stays."""
        with self._lock:
            self._cleared(instance, None)

    def _stored(self, instance: int, ev: Any) -> bool:
        g = self._graphs[instance]
        hashes = list(ev.block_hashes)
        n, tokens, size = len(hashes), list(ev.token_ids), int(ev.block_size)
        if n == 0:
            return True
        if len(tokens) != n * size:
            if n != 1:
                return False
            size = len(tokens)  # one block of its own length (a partial block's entry)
        extras = list(ev.extra_keys) if ev.extra_keys else [None] * n
        if len(extras) != n:
            return False
        holding = Holding(ev.medium or "GPU", ev.locality or "LOCAL", ev.ownership)
        parent = ev.parent_block_hash
        for i, h in enumerate(hashes):
            node = g.nodes.get(h)
            if node is None:
                key = (tuple(tokens[i * size:(i + 1) * size]), extra_key(extras[i]))
                node = g.nodes[h] = _Node(parent, key)
                g.children.setdefault(parent, {}).setdefault(len(key[0]), {})[key] = h
            node.holdings.add(holding)
            parent = h
        return True

    def _removed(self, instance: int, ev: Any) -> bool:
        """Drop the holdings the event names. A removal from a shared tier
        (``REMOTE``) is gone for every instance that reads the tier: the
        same block reported by them (by the same hash) loses it too."""
        medium = ev.medium or "GPU"
        graphs = [self._graphs[instance]]
        if ev.locality == "REMOTE":
            graphs += [self._graphs[j] for j in sorted(self._readers[instance])]
        for g in graphs:
            for h in ev.block_hashes:
                node = g.nodes.get(h)
                if node is None:
                    continue
                node.holdings = {x for x in node.holdings
                                 if not (x.medium == medium and ev.locality in (None, x.locality)
                                         and ev.ownership in (None, x.ownership))}
                self._prune(g, h)
        return True

    def _cleared(self, instance: int, ev: Any) -> bool:
        g = self._graphs[instance]
        for node in g.nodes.values():
            node.holdings = {x for x in node.holdings if x.medium != "GPU"}
        for h in list(g.nodes):
            self._prune(g, h)
        return True

    @staticmethod
    def _prune(g: _Graph, h: BlockHash | None) -> None:
        """Drop ``h`` and then its ancestors while they hold nothing and have
        no children: an unheld block stays as long as a walk must pass it."""
        while h is not None and h in g.nodes:
            node = g.nodes[h]
            if node.holdings or g.children.get(h):
                return
            del g.nodes[h]
            g.children.pop(h, None)
            siblings = g.children.get(node.parent, {})
            same = siblings.get(len(node.key[0]), {})
            if same.get(node.key) == h:
                del same[node.key]
                if not same:
                    del siblings[len(node.key[0])]
                if not siblings:
                    g.children.pop(node.parent, None)
            h = node.parent

    # ------------------------------------------------------------ predictions

    def predict(self, tokens: Sequence[int], salt: str | None = None) -> list[Prediction]:
        """Each instance's longest readable prefix of ``tokens`` (a prompt of
        tenant ``salt``), with the fastest holding of each block; where
        several paths reach the same length, the one with the most tokens in
        the fastest class (then the next) is given."""
        tokens = tuple(tokens)
        with self._lock:
            walks = [_walk(g, tokens, salt) for g in self._graphs]
        out = []
        for i in range(self.instances):
            usable: list[Segment] = []
            for j, walk in enumerate(walks):
                if j != i and i not in self._readers[j]:
                    continue
                for start, end, holdings in walk:
                    held = [x for x in holdings if j == i or x.locality == "REMOTE"]
                    if held:
                        usable.append(Segment(start, end, min(held, key=_order), j))
            out.append(_best_path(usable))
        return out

    def blocks(self, instance: int) -> int:
        """Blocks ``instance`` has reported and not all lost (tree nodes)."""
        with self._lock:
            return len(self._graphs[instance].nodes)


_HANDLERS = {"BlockStored": PrefixIndex._stored, "BlockRemoved": PrefixIndex._removed,
             "AllBlocksCleared": PrefixIndex._cleared}


def _order(h: Holding) -> tuple:
    return (h.speed, h.medium, h.ownership or "")


def _walk(g: _Graph, tokens: tuple[int, ...], salt: str | None) -> list[tuple[int, int, frozenset[Holding]]]:
    """The blocks of one instance's tree that ``tokens`` matches from the
    root, in order, with what holds each (possibly nothing)."""
    out: list[tuple[int, int, frozenset[Holding]]] = []
    pos, parent = 0, None
    while True:
        by_len = g.children.get(parent)
        if not by_len:
            return out
        for n in sorted(by_len, reverse=True):
            h = by_len[n].get((tokens[pos:pos + n], prompt_extra(pos, salt))) if pos + n <= len(tokens) else None
            if h is not None:
                out.append((pos, pos + n, frozenset(g.nodes[h].holdings)))
                pos, parent = pos + n, h
                break
        else:
            return out


def _best_path(segments: list[Segment]) -> Prediction:
    """The longest chain of consecutive segments from token 0; among chains
    of that length, the most tokens in the fastest class, then the next."""
    best: dict[int, tuple[tuple[int, ...], tuple[Segment, ...]]] = {0: ((0,) * len(CLASSES), ())}
    for s in sorted(segments, key=lambda s: (s.start, s.end)):
        if s.start not in best:
            continue
        vec, path = best[s.start]
        vec = tuple(v + (s.end - s.start if k == s.holding.speed else 0) for k, v in enumerate(vec))
        if s.end not in best or vec > best[s.end][0]:
            best[s.end] = (vec, path + (s,))
    end = max(best)
    return Prediction(end, best[end][1])
