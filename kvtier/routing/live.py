"""An events-driven router over live engines: one subscriber per engine
feeding one prefix index, and the router choosing over it.

    with EventsRouting(["tcp://node1:5557", "tcp://node2:5557"]) as er:
        k = er.choose(tokens)           # the index of the server to send to
        er.begin(k); ...; er.end(k)     # around the request
        er.stats()                      # per server: events received, gaps, lag

Server ``k`` is the engine whose events come from ``events[k]``: the
caller keeps its list of servers in the same order. An entry
``tcp://node1:5557?replay=tcp://node1:5558`` names the engine's replay
endpoint too, so that the index starts from what the engine already holds
and holes in its stream are filled (``subscriber``). ``shared``: groups of
server indices that read one shared tier (default: all of them read one).

Thread ownership: ``start`` starts the subscribers' threads, ``close``
joins them; ``choose``, ``begin``, ``end`` and ``stats`` may be called from
any thread (the index and the router lock their own state).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvtier.errors import ConfigError
from kvtier.routing.index import PrefixIndex
from kvtier.routing.router import Choice, Router
from kvtier.routing.subscriber import EventSubscriber, split_endpoint


class EventsRouting:
    def __init__(self, events: Sequence[str], *, topic: str = "", shared: Sequence[Collection[int]] | None = None,
                 seed: int = 0):
        if not events:
            raise ConfigError("events", "no events endpoint given", "give one tcp://HOST:PORT per server")
        self.events = list(events)
        self.index = PrefixIndex(len(events), shared)
        self.router = Router(self.index, seed)
        self.subscribers = []
        for k, text in enumerate(events):
            url, replay = split_endpoint(text, "events")
            self.subscribers.append(EventSubscriber(url, sink=self._sink(k), topic=topic, replay_endpoint=replay,
                                                    on_restart=lambda k=k: self.index.clear_gpu(k)))

    def _sink(self, k: int):
        return lambda batch: self.index.apply(k, batch.events)

    def start(self) -> None:
        started = []
        try:
            for s in self.subscribers:
                s.start()
                started.append(s)
        except BaseException:
            for s in started:
                s.close()
            raise

    def close(self) -> None:
        for s in self.subscribers:
            s.close()

    def __enter__(self) -> EventsRouting:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def choose(self, tokens: Sequence[int], salt: str | None = None) -> Choice:
        return self.router.choose(tokens, salt)

    def begin(self, k: int) -> None:
        self.router.begin(k)

    def end(self, k: int) -> None:
        self.router.end(k)

    def stats(self) -> list[dict]:
        """Per server: its events endpoint, the subscriber's counters
        (``batches``, ``events``, ``missed_at_join``, ``gaps``,
        ``recovered``, ``lag_s_mean``, ``lag_s_max`` ...), the blocks the
        index knows of it, and the events it could not use."""
        return [{"events_endpoint": s.endpoint, **s.stats(), "blocks": self.index.blocks(k),
                 "ignored_events": self.index.ignored[k], "malformed_events": self.index.malformed[k]}
                for k, s in enumerate(self.subscribers)]
