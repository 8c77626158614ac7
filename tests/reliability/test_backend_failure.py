"""Case 12: the shared directory dies, comes back, or hangs.

- Dies: the directory is a bind mount the test detaches (``umount -l``), so
  kvtier suddenly sees an empty folder, then attaches it again (same data).
  Every call returns promptly, requests recompute, saves are dropped and
  counted, nothing is written beneath the dead mount point; when the data
  returns, hits resume on their own.
- Hangs: the directory is a FUSE mount (``kvtier.bench.faultfs``) that the
  test switches to "hang": every file-system call blocks in the kernel, as
  on a shared mount whose server went away. Lookups and loads return within
  their deadlines, the breaker then skips the tier without calling it (the
  mount counts the calls it held), saves never block the caller, and hits
  resume once the mount answers again.

The Redis and S3 tiers have the same cases against real servers (SIGSTOP,
SIGKILL, restart): tests/tiers/redis/test_redis.py and tests/tiers/s3/test_s3.py.
"""

from __future__ import annotations

import time

import pytest

from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from tests.support import DTYPE, OBJ, keys_for, memory_config, payload_for, shape_for, shared_config

CHUNKS = 4


def _store(path, metrics, **kw) -> TieredStore:
    cfg = StoreConfig(
        tiers=(TierSpec("memory", memory_config(64 * OBJ)), TierSpec("shared", shared_config(path, 64 * OBJ))),
        breaker_threshold=2, breaker_cooldown_s=kw.pop("cooldown", 0.5),
        lookup_timeout_s=kw.pop("lookup_timeout", 0.3), load_timeout_s=kw.pop("load_timeout", 0.5), **kw,
    )
    return TieredStore(cfg, metrics)


def _save(store, keys) -> None:
    store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])


def _request(store, keys) -> tuple[int, float]:
    """Admission as the connector does it: look up, load what hits; the rest
    is recomputed. Returns (chunks served, seconds)."""
    t0 = time.monotonic()
    plan = store.lookup(keys)
    bufs = [bytearray(len(payload_for(k))) for k in keys]
    n = store.load(keys, bufs, plan) if plan.chunks else 0
    assert [bytes(b) for b in bufs[:n]] == [payload_for(k) for k in keys[:n]]
    return n, time.monotonic() - t0


def test_a_shared_directory_that_vanishes_and_returns(small_fs, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    mount = small_fs.bind(data, "shared")
    metrics = Metrics()
    old, new = keys_for(600, CHUNKS), keys_for(601, CHUNKS)
    with _store(mount, metrics) as store:
        shared = store.tier("shared")
        _save(store, old)
        assert store.flush(10)
        store.tier("memory").clear()
        assert _request(store, old)[0] == CHUNKS

        small_fs.detach(mount)  # the backend is gone: an empty folder
        for _ in range(4):
            store.tier("memory").clear()
            n, took = _request(store, old)
            assert n == 0 and took < 1.0
            _save(store, new)
            assert store.flush(10)
        # Every save failed and was counted. (The breaker may stay closed:
        # to a lookup an empty folder is a clean, fast miss.)
        assert metrics.value("kvtier_dropped_saves_total", tier="shared", reason="error") >= 4
        assert metrics.value("kvtier_errors_total", tier="shared", op="store") >= 2

        assert list(mount.iterdir()) == [], "kvtier wrote beneath the dead mount point"

        small_fs.bind(data, "shared")  # back, with its data
        time.sleep(0.6)  # the cooldown: the next call probes
        store.tier("memory").clear()
        deadline = time.monotonic() + 5
        while _request(store, old)[0] != CHUNKS:
            assert time.monotonic() < deadline, "hits never resumed after the directory came back"
            store.tier("memory").clear()
            time.sleep(0.1)
        assert shared.breaker.state == "closed"
        _save(store, new)
        assert store.flush(10)
        store.tier("memory").clear()
        assert _request(store, new)[0] == CHUNKS


@pytest.fixture
def faulty_mount(tmp_path):
    from kvtier.bench.faultfs import mounted

    (tmp_path / "src").mkdir()
    with mounted(tmp_path / "src", tmp_path / "shared") as fs:
        yield fs


def test_a_hanging_shared_directory_costs_bounded_time_then_is_skipped(faulty_mount):
    metrics = Metrics()
    keys, other = keys_for(800, CHUNKS), keys_for(801, CHUNKS)
    hang = faulty_mount
    with _store(hang.path, metrics, cooldown=1.0, save_queue_bytes=8 * OBJ) as store:
        shared = store.tier("shared")
        _save(store, keys)
        assert store.flush(10)
        store.tier("memory").clear()
        plan = store.lookup(keys)  # looked up before the hang, loaded during it
        assert plan.chunks == CHUNKS

        hang.set(mode="hang")
        t0 = time.monotonic()
        assert store.load(keys, [bytearray(len(payload_for(k))) for k in keys], plan) == 0
        assert time.monotonic() - t0 < 0.5 + 0.5  # load_timeout_s + slack
        n, took = _request(store, keys)
        assert n == 0 and took < 0.3 + 0.5  # lookup_timeout_s + slack
        assert shared.breaker.state == "open"
        calls = hang.hung()
        assert calls > 0
        for _ in range(5):  # skipped: no call reaches the hanging backend
            n, took = _request(store, keys)
            assert n == 0 and took < 0.2  # (microseconds, but this machine is shared)
            t0 = time.monotonic()
            _save(store, other)  # never blocks the caller
            assert time.monotonic() - t0 < 0.2
        assert hang.hung() == calls
        dropped = sum(metrics.value("kvtier_dropped_saves_total", tier="shared", reason=r)
                      for r in ("breaker_open", "queue_full"))
        assert dropped >= CHUNKS

        hang.heal()
        time.sleep(1.1)  # the cooldown
        store.tier("memory").clear()
        deadline = time.monotonic() + 5
        while _request(store, keys)[0] != CHUNKS:
            assert time.monotonic() < deadline, "hits never resumed after the hang ended"
            store.tier("memory").clear()
            time.sleep(0.1)
        assert shared.breaker.state == "closed"


def test_a_mount_where_each_open_is_a_round_trip_is_read_with_threads(faulty_mount, caplog):
    """Where each open is a round trip, one AIO driver thread opens a load's
    objects one after the other. After three loads that spent most of their
    time opening, the tier reads with pool threads (side by
    side), says so once and in its gauge, and no load misses."""
    metrics = Metrics()
    keys = keys_for(830, CHUNKS)
    cfg = StoreConfig(tiers=(TierSpec("shared", shared_config(faulty_mount.path, 64 * OBJ)),))
    with TieredStore(cfg, metrics) as store:
        shared = store.tier("shared")
        assert shared.config.o_direct and shared.config.aio and shared.dir.direct_ok
        _save(store, keys)
        assert store.flush(10)
        assert metrics.value("kvtier_aio_reads", tier="shared") == 1
        faulty_mount.set(latency_s=0.005)  # each read a 5 ms round trip
        for _ in range(3):
            assert _request(store, keys)[0] == CHUNKS
        assert not shared._aio_ok
        assert metrics.value("kvtier_aio_reads", tier="shared") == 0
        warned = [r for r in caplog.records if "AIO loads spent most of their time opening files" in r.getMessage()]
        assert len(warned) == 1
        n, took = _request(store, keys)  # on threads: the reads side by side
        assert n == CHUNKS
        assert metrics.value("kvtier_errors_total", tier="shared", op="load") == 0


@pytest.mark.parametrize("aio", [True, False], ids=["aio", "threads"])
def test_a_mount_that_refuses_o_direct_reads_is_read_buffered_without_a_miss(faulty_mount, caplog, aio):
    """The default read path is O_DIRECT (through native AIO): a file system
    that opens files with O_DIRECT but refuses the reads (EINVAL) must cost
    no hit and no error; the tier reads it buffered from then on, and says so
    once."""
    metrics = Metrics()
    keys = keys_for(820, CHUNKS)
    cfg = StoreConfig(tiers=(TierSpec("shared", shared_config(faulty_mount.path, 64 * OBJ, aio=aio)),))
    with TieredStore(cfg, metrics) as store:
        shared = store.tier("shared")
        assert shared.config.o_direct and shared.dir.direct_ok
        _save(store, keys)
        assert store.flush(10)
        faulty_mount.set(mode="no-direct")
        for _ in range(2):
            assert _request(store, keys)[0] == CHUNKS
        assert not shared.dir.direct_ok
        assert metrics.value("kvtier_errors_total", tier="shared", op="load") == 0
        assert shared.breaker.state == "closed"
        refusals = [r for r in caplog.records if "reading it buffered from now on" in r.getMessage()]
        assert len(refusals) == 1
