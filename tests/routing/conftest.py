from __future__ import annotations

import pytest

from kvtier.routing.live import EventsRouting
from tests.routing.support import Engine


@pytest.fixture
def engines():
    """``engines(n, **kw)``: n publishers like vLLM engines', shut down after the test."""
    made: list[Engine] = []

    def make(n: int, **kw) -> list[Engine]:
        made.extend(Engine(**kw) for _ in range(n))
        return made[-n:]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def cluster(engines):
    """``cluster(n, shared=None)``: n engines and an ``EventsRouting`` over
    their streams, joined (every later batch reaches it)."""
    routings: list[EventsRouting] = []

    def make(n: int, shared=None, seed: int = 0):
        es = engines(n)
        er = EventsRouting([e.url for e in es], topic="kv", shared=shared, seed=seed)
        routings.append(er)
        er.start()
        for e, sub in zip(es, er.subscribers):
            e.join(sub)
        return es, er

    yield make
    for er in routings:
        er.close()
