"""Choose the instance that serves a prompt, from the index's predictions.

    router = Router(index, seed=0)
    choice = router.choose(tokens, salt=None)   # Choice(instance, score, predictions)
    router.begin(choice.instance) ... router.end(choice.instance)

The score of instance ``i`` for a prompt, compared as a tuple (greater wins)::

    score(i) = (matched tokens,
                tokens held on GPU, on CPU, on local storage, on remote storage,
                -requests in flight on i)

that is: the longest predicted prefix hit; among equal hits, the one held
in faster media (``index.CLASSES``: a block on the instance's own GPU costs
nothing to reuse, host memory a copy, local storage a read, a shared tier a
network read); then the least busy instance. Instances whose scores are
equal are drawn at random (seeded, so that a run can be replayed). The
counts in flight are the caller's: ``begin`` when a request is sent,
``end`` when it finished or failed.

Thread ownership: ``choose``, ``begin`` and ``end`` may be called from any
thread; the counts in flight and the random draw are under one lock.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.routing.index import Prediction, PrefixIndex


def score(prediction: Prediction, in_flight: int) -> tuple[int, ...]:
    """The module docstring's score: greater is better."""
    return (prediction.tokens, *prediction.by_class(), -in_flight)


@dataclass(frozen=True)
class Choice:
    instance: int
    score: tuple[int, ...]
    predictions: tuple[Prediction, ...]  # per instance


class Router:
    def __init__(self, index: PrefixIndex, seed: int = 0):
        self.index = index
        self._rng = random.Random(seed)
        self._in_flight = [0] * index.instances
        self._lock = threading.Lock()

    def choose(self, tokens: Sequence[int], salt: str | None = None) -> Choice:
        predictions = tuple(self.index.predict(tokens, salt))
        with self._lock:
            scores = [score(p, n) for p, n in zip(predictions, self._in_flight)]
            top = max(scores)
            k = self._rng.choice([i for i, s in enumerate(scores) if s == top])
        return Choice(k, top, predictions)

    def begin(self, instance: int) -> None:
        with self._lock:
            self._in_flight[instance] += 1

    def end(self, instance: int) -> None:
        with self._lock:
            self._in_flight[instance] -= 1

    def in_flight(self) -> list[int]:
        with self._lock:
            return list(self._in_flight)
