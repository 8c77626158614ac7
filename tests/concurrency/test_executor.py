"""PriorityExecutor (priorities, draining, cancelling, fork) and ByteWindow."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvtier.concurrency.executor import DELETE, LOAD, MAINTENANCE, STORE, ByteWindow, PriorityExecutor
from tests.support import spin_cpu


@pytest.fixture
def one_worker():
    ex = PriorityExecutor("t", 1)
    yield ex
    ex.close(cancel_pending=True)


def _block(ex: PriorityExecutor) -> threading.Event:
    """Occupy ``ex``'s single worker until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def job():
        started.set()
        assert release.wait(10)

    ex.submit(LOAD, job)
    assert started.wait(10)
    return release


def test_queued_jobs_run_by_priority_then_fifo(one_worker):
    release = _block(one_worker)
    order = []
    jobs = [(STORE, "s1"), (MAINTENANCE, "m1"), (STORE, "s2"), (DELETE, "d1"), (LOAD, "l1"), (LOAD, "l2"), (DELETE, "d2")]
    futs = [one_worker.submit(p, order.append, name) for p, name in jobs]
    assert one_worker.pending() == len(jobs)
    release.set()
    for f in futs:
        f.result(10)
    assert order == ["l1", "l2", "d1", "d2", "s1", "s2", "m1"]


def test_a_load_overtakes_a_backlog_of_stores(one_worker):
    release = _block(one_worker)
    order = []
    stores = [one_worker.submit(STORE, order.append, f"s{i}") for i in range(20)]
    load = one_worker.submit(LOAD, order.append, "load")
    release.set()
    load.result(10)
    for f in stores:
        f.result(10)
    assert order[0] == "load"


def test_results_and_exceptions_reach_the_future():
    ex = PriorityExecutor("t", 2)
    try:
        assert ex.submit(LOAD, lambda a, b: a + b, 2, 3).result(10) == 5

        def boom():
            raise OSError("disk on fire")

        with pytest.raises(OSError, match="disk on fire"):
            ex.submit(STORE, boom).result(10)
        assert ex.submit(LOAD, lambda: "still serving").result(10) == "still serving"
    finally:
        ex.close()


def test_close_drains_queued_jobs_and_joins_workers(one_worker):
    release = _block(one_worker)
    done = []
    futs = [one_worker.submit(STORE, done.append, i) for i in range(5)]
    threading.Timer(0.05, release.set).start()
    one_worker.close()
    assert done == list(range(5))
    assert all(f.done() and not f.cancelled() for f in futs)
    assert [t for t in threading.enumerate() if t.name.startswith("kvtier-t-")] == []
    with pytest.raises(RuntimeError):
        one_worker.submit(LOAD, print)


def test_close_can_cancel_queued_jobs():
    ex = PriorityExecutor("t", 1)
    release = _block(ex)
    ran = []
    futs = [ex.submit(STORE, ran.append, i) for i in range(5)]
    threading.Timer(0.05, release.set).start()
    ex.close(cancel_pending=True)
    assert ran == []
    assert all(f.cancelled() for f in futs)


def test_no_threads_until_the_first_submit():
    before = {t.name for t in threading.enumerate()}
    ex = PriorityExecutor("lazy", 3)
    assert {t.name for t in threading.enumerate()} == before
    ex.submit(LOAD, lambda: None).result(10)
    assert len([t for t in threading.enumerate() if t.name.startswith("kvtier-lazy-")]) == 3
    ex.close()


def test_workers_must_be_positive():
    with pytest.raises(ValueError):
        PriorityExecutor("t", 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_workers():
    ex = PriorityExecutor("t", 1)
    ex.submit(LOAD, lambda: None).result(10)  # the parent's worker exists
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the parent's threads do not exist here
        ok = False
        try:
            ok = ex.submit(LOAD, lambda: 41 + 1).result(5) == 42
            ex.close()
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    assert ex.submit(LOAD, lambda: "parent").result(10) == "parent"
    ex.close()


# ---------------------------------------------------------------- ByteWindow


def test_window_admits_work_up_to_its_limit():
    w = ByteWindow(100)
    assert w.acquire(60, timeout=0)
    assert w.acquire(40, timeout=0)
    assert not w.acquire(1, timeout=0.01)
    w.release(40)
    assert w.acquire(30, timeout=0)
    assert not w.acquire(20, timeout=0.01)


def test_an_oversized_item_goes_alone():
    w = ByteWindow(100)
    assert w.acquire(500, timeout=0)  # empty window: never stall
    assert not w.acquire(1, timeout=0.01)
    w.release(500)
    assert w.acquire(10, timeout=0)
    assert not w.acquire(500, timeout=0.01)  # not alone any more


def test_release_wakes_a_waiting_acquirer_without_rounds():
    w = ByteWindow(100)
    assert w.acquire(50) and w.acquire(50)
    got = threading.Event()

    def waiter():
        assert w.acquire(50, timeout=10)
        got.set()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.02)
    assert not got.is_set()
    w.release(50)  # one of two completions frees enough: no barrier
    assert got.wait(10)
    t.join()


def test_window_limit_is_at_least_one():
    w = ByteWindow(0)
    assert w.limit == 1
    assert w.acquire(5, timeout=0)


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="thread placement needs Linux and two CPUs")


def _where(ex: PriorityExecutor) -> set[int]:
    """The CPUs a job of ``ex`` runs on."""
    return ex.submit(LOAD, os.sched_getaffinity, 0).result(10)


def _pinned(cpus, fn):
    """``fn()`` in a thread pinned to ``cpus``, as an engine pins its own (a
    thread it starts inherits that pin)."""
    out: list = []

    def run():
        os.sched_setaffinity(0, cpus)
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join(20)
    return out[0]


@needs_two_cpus
def test_threads_inherit_the_pin_of_the_thread_that_starts_them_unless_placed():
    from kvtier.concurrency import executor

    every = set(os.sched_getaffinity(0))
    one = {min(every)}
    try:
        executor.place_io_threads(None)
        inherited = PriorityExecutor("inherit", 1)
        assert _pinned(one, lambda: _where(inherited)) == one
        executor.place_io_threads(every)
        placed = PriorityExecutor("placed", 1)
        assert _pinned(one, lambda: _where(placed)) == every
        # Threads running before the placement move too.
        executor.place_io_threads({max(every)})
        assert _where(inherited) == {max(every)}
        assert _where(placed) == {max(every)}
    finally:
        executor.place_io_threads(None)
        inherited.close()
        placed.close()


def test_each_job_tells_its_kind_and_the_cpu_its_own_thread_spent():
    seen: list[tuple[str, float]] = []
    ex = PriorityExecutor("t", 1, on_cpu=lambda kind, s: seen.append((kind, s)))
    try:
        ex.submit(LOAD, spin_cpu, 0.05).result(10)
        assert seen[-1][0] == "load" and seen[-1][1] >= 0.05  # told before the future resolves
        ex.submit(STORE, time.sleep, 0.2).result(10)
        assert seen[-1][0] == "store" and seen[-1][1] < 0.05  # asleep is not CPU

        def boom():
            spin_cpu(0.02)
            raise OSError("gone")

        with pytest.raises(OSError):
            ex.submit(DELETE, boom).result(10)
        assert seen[-1][0] == "delete" and seen[-1][1] >= 0.02  # a job that raised is counted too
        ex.submit(MAINTENANCE, lambda: None).result(10)
        assert [k for k, _ in seen] == ["load", "store", "delete", "maintenance"]
    finally:
        ex.close()


def test_a_failing_cpu_count_never_keeps_a_job_from_resolving(caplog):
    def broken(kind, seconds):
        raise RuntimeError("metrics backend gone")

    ex = PriorityExecutor("t", 1, on_cpu=broken)
    try:
        assert ex.submit(LOAD, lambda: 7).result(10) == 7
        with pytest.raises(OSError):
            ex.submit(STORE, lambda: (_ for _ in ()).throw(OSError("gone"))).result(10)
        assert "counting a job's CPU failed" in caplog.text
    finally:
        ex.close()
