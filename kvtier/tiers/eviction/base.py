"""The eviction seam: which objects a tier with a byte capacity removes
first, and how many bytes go at once.

A policy holds the keys a tier holds, each with its size in bytes and an
optional value the tier keeps with it (an object, a path, a stamp). A
policy class writes only its order: ``_admitted``, ``_used_again`` and
``_dropped`` keep it as keys come, are used and go, and ``__iter__`` walks
it, first to go first. Everything else derives from those: ``touch``,
``insert``, ``remove``, ``victims`` (the keys to remove, in order, to free
so many bytes) and ``to_free`` (how many bytes a store must free: just
enough by default, down to a low watermark in ``WatermarkPolicy``).
Nothing is removed by the policy itself: the tier removes each victim
from its storage and then from the policy (``remove``), since only it knows
whether the bytes are really gone.

Two kinds of tier feed a policy:

- a tier that sees every use of its objects in its own process (memory,
  disk: the disk tier's order survives restarts through its access log)
  calls ``touch``/``insert``/``remove`` as they happen, and keeps one
  policy for its life;
- a tier whose objects many processes share (shm, the shared directory,
  S3) has no such stream: another process's reads show only as each
  object's recency stamp (its mtime, or S3's LastModified). It rebuilds a
  policy from a scan on each pass (``rank``: every object inserted oldest
  stamp first). Only a policy whose order is the order of last use alone
  (``ranks_by_recency``: LRU, watermark) can be rebuilt so; the tier's
  config refuses the others (``registry.check``).

Thread-safety: none; the tier's own lock covers its policy. Iterate, then
change: ``victims`` returns a list for that reason.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Generic, Iterable, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")
E = TypeVar("E")


class EvictionPolicy(Generic[K, V]):
    name: ClassVar[str] = ""
    # Keys of a tier's config the policy reads besides ``capacity`` (``of``):
    # a tier whose config has not got them cannot run it.
    settings: ClassVar[tuple[str, ...]] = ()
    # Its order is the order of last use alone, so a scan of recency stamps
    # rebuilds it (``rank``).
    ranks_by_recency: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # bytes
        self.used = 0  # bytes of the keys held
        self._held: dict[K, tuple[int, V | None]] = {}  # key -> (bytes, value)

    @classmethod
    def of(cls, config) -> "EvictionPolicy":
        """The policy under a tier's config (``capacity`` and ``settings``)."""
        return cls(config.capacity)

    # ------------------------------------------------------------ a policy's order
    def _admitted(self, key: K) -> None:
        """``key`` came in (it is in ``_held`` already)."""

    def _used_again(self, key: K) -> None:
        """``key``, held, was used (a touch, or an insert of a held key)."""

    def _dropped(self, key: K) -> None:
        """``key`` went (it is out of ``_held`` already)."""

    def __iter__(self) -> Iterator[K]:
        """The held keys, first to go first."""
        raise NotImplementedError

    # ------------------------------------------------------------ the seam
    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def size(self, key: K) -> int:
        return self._held[key][0]

    def get(self, key: K, default: V | None = None) -> V | None:
        e = self._held.get(key)
        return default if e is None else e[1]

    def touch(self, key: K) -> bool:
        """A use of ``key``; False if it is not held."""
        if key not in self._held:
            return False
        self._used_again(key)
        return True

    def insert(self, key: K, size: int, value: V | None = None) -> None:
        """Hold ``key`` (``size`` bytes, with ``value``). A held key takes the
        new size and value, and the insert counts as a use."""
        old = self._held.get(key)
        self._held[key] = (size, value)
        if old is None:
            self.used += size
            self._admitted(key)
        else:
            self.used += size - old[0]
            self._used_again(key)

    def remove(self, key: K) -> int | None:
        """Stop holding ``key``: the bytes it held, None if it was not held."""
        e = self._held.pop(key, None)
        if e is None:
            return None
        self.used -= e[0]
        self._dropped(key)
        return e[0]

    def clear(self) -> None:
        for key in list(self._held):
            self.remove(key)

    def to_free(self, used: int, incoming: int = 0) -> int:
        """Bytes to free before ``incoming`` more bytes are stored, with
        ``used`` bytes in use (the tier's figure: it may count more than the
        keys held, such as writes in flight): just enough to fit."""
        return max(0, used + incoming - self.capacity)

    def over(self, used: int) -> bool:
        """Whether usage ``used`` asks for eviction without a store (a
        collector's pass)."""
        return self.to_free(used) > 0

    def victims(self, need: int, evictable: Callable[[K], bool] | None = None) -> list[K]:
        """The keys to remove, first to go first, to free at least ``need``
        bytes: every evictable key when they hold less, none for
        ``need`` <= 0. ``evictable`` (default: all) skips keys in use."""
        out: list[K] = []
        if need <= 0:
            return out
        freed = 0
        held = self._held
        for key in self:
            if evictable is None or evictable(key):
                out.append(key)
                freed += held[key][0]
                if freed >= need:
                    break
        return out


def rank(policy: EvictionPolicy, entries: Iterable[E], size: Callable[[E], int],
         recency: Callable[[E], float]) -> EvictionPolicy:
    """``policy`` filled from a scan of a shared store: each entry (the key)
    inserted with its size, oldest recency stamp first (equal stamps in scan
    order), which is the order a policy that ``ranks_by_recency`` keeps."""
    if not policy.ranks_by_recency:
        raise TypeError(f"eviction policy {policy.name!r} cannot be rebuilt from recency stamps")
    for e in sorted(entries, key=recency):
        policy.insert(e, size(e))
    return policy
