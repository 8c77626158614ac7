"""The subscriber against vLLM's own publisher: decoding, counts, lag,
batches missed at join and in gaps, replay, a publisher's restart."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvtier.errors import ConfigError
from kvtier.routing.live import EventsRouting
from kvtier.routing.subscriber import EventSubscriber, split_endpoint
from tests.routing.support import Engine, prompt, stored


def test_batches_are_decoded_counted_and_timed(engines):
    (e,) = engines(1)
    got = []
    with EventSubscriber(e.url, sink=got.append, topic="kv") as sub:
        first = e.join(sub)
        p = prompt(1, 2)
        e.publish(stored([1, 2], None, p[:32]), stored([3], 2, p[32:48]), ts=time.time() - 2.0)
        seq = e.send(sub, stored([4], None, p[:16]))
        st = sub.stats()
    assert st["batches"] == seq - first + 1 and st["events"] == 3
    assert st["missed_at_join"] == first and st["gaps"] == 0 and st["last_seq"] == seq
    assert 2.0 <= st["lag_s_max"] < 30 and 0 <= st["lag_s_last"] < 2.0 and st["lag_s_mean"] > 0
    ev = got[-2].events[0]
    assert type(ev).__name__ == "BlockStored" and ev.block_hashes == [1, 2] and ev.token_ids == p[:32]


def test_a_subscriber_that_joins_late_counts_what_it_missed(engines):
    (e,) = engines(1)
    for _ in range(5):
        e.publish()  # no subscriber yet: the PUB socket drops these
    time.sleep(0.5)
    with EventSubscriber(e.url, sink=lambda b: None, topic="kv") as sub:
        first = e.join(sub)
        st = sub.stats()
    assert first >= 5 and st["missed_at_join"] == first and st["first_seq"] == first
    assert st["gaps"] == 0 and st["recovered"] == 0


def test_replay_gives_a_late_router_what_the_engine_already_holds(engines):
    p = prompt(1, 3)
    with_replay, without = engines(1, replay=True)[0], engines(1)[0]
    for e in (with_replay, without):
        e.publish(stored([1], None, p[:16]))
        e.publish(stored([2, 3], 1, p[16:48]))
    time.sleep(0.5)
    with EventsRouting([with_replay.spec, without.spec], topic="kv") as er:
        # The one with a replay endpoint is known at start, before any live batch.
        assert [x.tokens for x in er.index.predict(p)] == [48, 0]
        for e, sub in zip((with_replay, without), er.subscribers):
            e.join(sub)
        a, b = er.stats()
    assert a["first_seq"] == 0 and a["missed_at_join"] == 0 and a["recovered"] == 2 and a["gaps"] == 0
    assert b["missed_at_join"] >= 2 and b["recovered"] == 0


def test_a_subscriber_that_falls_behind_counts_the_gaps_and_replay_fills_them(engines):
    """The PUB socket drops what a subscriber busy elsewhere cannot take
    once the high-water marks and socket buffers are full."""
    for replay in (False, True):
        (e,) = engines(1, hwm=1, replay=replay)
        gate, handed = threading.Event(), []

        def sink(batch):
            handed.append(len(batch.events))
            if len(handed) == 2:
                gate.wait(60)  # the subscriber's thread is stuck here

        with EventSubscriber(e.url, sink=sink, topic="kv", rcvhwm=1, replay_endpoint=e.replay_url) as sub:
            e.join(sub)
            big = list(range(40_000, 60_000))  # about 60 kB per batch
            for _ in range(1000):  # 60 MB: more than the socket buffers hold
                e.publish(stored([1], None, big, size=len(big)))
            deadline = time.monotonic() + 60
            while e.publisher._event_queue.qsize() and time.monotonic() < deadline:  # vLLM's send queue
                time.sleep(0.05)
            time.sleep(0.3)
            gate.set()
            deadline = time.monotonic() + 60
            while not sub.wait_for(e.publish(), 0.2):
                assert time.monotonic() < deadline
            st = sub.stats()
        assert st["batches"] + st["undecodable"] + st["gaps"] + st["missed_at_join"] == st["last_seq"] + 1
        if replay:
            assert st["gaps"] == 0 and st["recovered"] > 0, st
        else:
            assert st["gaps"] > 0 and st["recovered"] == 0, st


def test_a_restarted_engine_loses_its_gpu_blocks_but_not_its_tiers(engines):
    (e,) = engines(1)
    p = prompt(1, 2)
    with EventsRouting([e.url], topic="kv") as er:
        sub = er.subscribers[0]
        e.join(sub)
        e.send(sub, stored([1, 2], None, p[:32]), stored([1, 2], None, p[:32], medium="CPU", ownership="memory"))
        for _ in range(200):  # the restarted engine's numbers stay below these for a while
            e.publish()
        e.send(sub, stored([1], None, p[:16]))
        assert er.index.predict(p)[0].by_class() == (32, 0, 0, 0)
        e.close()
        e2 = restarted(e.port)  # its sequence starts at 0 again
        try:
            deadline = time.monotonic() + 30
            while sub.stats()["restarts"] == 0:
                assert time.monotonic() < deadline, sub.stats()
                e2.publish()
                time.sleep(0.05)
        finally:
            e2.close()
        assert er.index.predict(p)[0].by_class() == (0, 32, 0, 0)


def restarted(port: int, timeout_s: float = 10.0) -> Engine:
    """An engine on ``port`` again, once ZMQ's I/O thread let the old socket go."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Engine(port=port)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("text, problem", [
    ("tcp://*:5557", "no address to connect to"),
    ("node1:5557", "no address to connect to"),
    ("tcp://node1", "names no port"),
    ("tcp://node1:5557?resend=tcp://node1:5558", "the only option is ?replay=URL"),
])
def test_bad_endpoints_name_the_fix(text, problem):
    with pytest.raises(ConfigError, match="Fix:") as exc:
        split_endpoint(text, "--events")
    assert problem in exc.value.problem and exc.value.key == "--events"


def test_an_endpoint_may_name_its_replay_endpoint():
    assert split_endpoint("tcp://n:5557?replay=tcp://n:5558") == ("tcp://n:5557", "tcp://n:5558")
    assert split_endpoint("ipc:///tmp/kv") == ("ipc:///tmp/kv", None)
