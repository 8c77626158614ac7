"""The engine core's wait for its workers while kvtier loads (enginewait.py),
on vLLM's own SpinCondition over real ZeroMQ sockets: while a load is in
flight the reader blocks on the writer's notification instead of spinning
with sched_yield, and wakes when the writer notifies; otherwise vLLM's wait
is unchanged."""

from __future__ import annotations

import time

import pytest
import zmq

from vllm.distributed.device_communicators import shm_broadcast
from vllm.utils.network_utils import get_open_zmq_ipc_path

from kvtier.integrations.vllm import enginewait


@pytest.fixture
def spin(monkeypatch):
    yields = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(1))
    ctx = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = shm_broadcast.SpinCondition(False, ctx, address)
    reader = shm_broadcast.SpinCondition(True, ctx, address)
    time.sleep(0.2)  # the subscription reaches the publisher
    yield writer, reader, yields
    for s in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
              writer.local_notify_socket):
        s.close(linger=0)
    ctx.term()


def test_while_a_load_is_in_flight_the_reader_blocks_instead_of_spinning(spin):
    writer, reader, yields = spin
    quiet = enginewait.QuietWhileLoading()
    reader.record_read()
    reader.wait(timeout_ms=50)
    assert yields == [1]  # vLLM's own wait: one sched_yield, back at once
    quiet.loading(True)
    try:
        assert enginewait._loading
        reader.record_read()  # a reply just arrived: vLLM would spin for busy_loop_s
        for _ in range(20):
            t0 = time.monotonic()
            reader.wait(timeout_ms=10_000)
            # blocked on the socket, not spinning, and never for long: a lost
            # notification must not stall the engine for vLLM's 5 s recheck
            assert yields == [1] and time.monotonic() - t0 < 1
        writer.notify()
        t0 = time.monotonic()
        reader.wait(timeout_ms=10_000)
        assert time.monotonic() - t0 < 5  # the writer's notification wakes it
    finally:
        quiet.close()
    assert not enginewait._loading
    reader.record_read()
    reader.wait(timeout_ms=50)
    assert yields == [1, 1]  # after the load, vLLM's spin again


def test_spin_during_loads_leaves_vllms_wait_alone(spin):
    _, reader, yields = spin
    quiet = enginewait.QuietWhileLoading(enabled=False)
    quiet.loading(True)
    assert not enginewait._loading
    reader.record_read()
    reader.wait(timeout_ms=50)
    assert yields == [1]


def test_two_schedulers_of_one_process_each_hold_the_quiet_until_their_loads_end():
    a, b = enginewait.QuietWhileLoading(), enginewait.QuietWhileLoading()
    a.loading(True)
    b.loading(True)
    a.loading(True)  # said twice, counted once
    a.loading(False)
    assert enginewait._loading
    b.close()
    assert not enginewait._loading
