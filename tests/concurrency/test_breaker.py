"""CircuitBreaker with an injected clock: opens after the threshold, lets one
probe through after the cooldown, closes on success, re-opens on failure."""

from __future__ import annotations

import threading

from kvtier.concurrency.breaker import CircuitBreaker


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _breaker(threshold=3, cooldown=10.0):
    clock = Clock()
    return CircuitBreaker(threshold, cooldown, clock=clock), clock


def test_opens_after_threshold_consecutive_failures():
    b, _ = _breaker()
    for _ in range(2):
        b.record(False)
        assert b.state == "closed" and b.allow()
    b.record(False)
    assert b.state == "open"
    assert not b.allow()


def test_a_success_resets_the_failure_count():
    b, _ = _breaker()
    b.record(False)
    b.record(False)
    b.record(True)
    b.record(False)
    b.record(False)
    assert b.state == "closed" and b.allow()


def test_half_open_lets_exactly_one_probe_through():
    b, clock = _breaker()
    for _ in range(3):
        b.record(False)
    clock.t += 9.9
    assert b.state == "open" and not b.allow()
    clock.t += 0.1
    assert b.state == "half-open"
    assert b.allow()  # the probe
    assert not b.allow()  # nobody else while it is out
    assert not b.allow()


def test_a_successful_probe_closes():
    b, clock = _breaker()
    for _ in range(3):
        b.record(False)
    clock.t += 10
    assert b.allow()
    b.record(True)
    assert b.state == "closed"
    assert all(b.allow() for _ in range(5))
    b.record(False)  # the count started over
    assert b.state == "closed"


def test_a_failed_probe_reopens_for_a_full_cooldown():
    b, clock = _breaker()
    for _ in range(3):
        b.record(False)
    clock.t += 10
    assert b.allow()
    b.record(False)
    assert b.state == "open" and not b.allow()
    clock.t += 9.9
    assert not b.allow()
    clock.t += 0.1
    assert b.allow()


def test_probe_admission_is_exclusive_across_threads():
    b, clock = _breaker(threshold=1)
    b.record(False)
    clock.t += 10
    admitted = []
    start = threading.Barrier(8)

    def try_():
        start.wait(5)
        admitted.append(b.allow())

    threads = [threading.Thread(target=try_) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert admitted.count(True) == 1
