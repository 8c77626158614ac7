"""Disk tier specifics: recency that survives restarts, one owner per
directory, orphan sweeping, shrinking capacity."""

from __future__ import annotations

import errno
import os
import time

import pytest

from kvtier.config import ConfigError
from kvtier.concurrency.breaker import CircuitBreaker
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.layout import HOST
from tests.support import OBJ, assert_object, disk_config, make_chunks, payload_for


@pytest.fixture
def open_disk(tmp_path, metrics):
    opened = []

    def open_(capacity=64 * OBJ, **kw):
        t = DiskTier(disk_config(tmp_path / "disk", capacity, **kw), metrics)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.close()


def _present(tier, keys):
    return [i for i, k in enumerate(keys) if tier.lookup([k])]


def _read(tier, keys):
    n = 0
    for obj in tier.fetch(keys):
        assert_object(obj, keys[n])
        n += 1
    return n


def test_recency_survives_a_restart(open_disk):
    c = make_chunks(7)
    a, b, x, y = c.keys[:4]
    tier = open_disk(4 * OBJ)
    tier.store(c.objs[:4])  # stored in the order a, b, x, y
    assert _read(tier, [a]) == 1
    assert _read(tier, [b]) == 1  # recency now: x, y, a, b
    tier.close()

    tier = open_disk(4 * OBJ)
    assert _present(tier, c.keys) == [0, 1, 2, 3]
    tier.store([c.objs[4]])
    assert _present(tier, c.keys) == [0, 1, 3, 4]  # x went first
    tier.store([c.objs[5]])
    assert _present(tier, c.keys) == [0, 1, 4, 5]  # then y
    tier.store([c.objs[6]])
    assert _present(tier, c.keys) == [1, 4, 5, 6]  # then a, accessed before b
    assert not tier.dir.path(x).exists() and not tier.dir.path(a).exists()


def test_recency_survives_two_restarts(open_disk):
    c = make_chunks(4)
    tier = open_disk(3 * OBJ)
    tier.store(c.objs[:3])
    _read(tier, c.keys[:1])  # recency: 1, 2, 0
    tier.close()
    open_disk(3 * OBJ).close()  # a restart with no activity compacts the log
    tier = open_disk(3 * OBJ)
    tier.store([c.objs[3]])
    assert _present(tier, c.keys) == [0, 2, 3]


def test_objects_without_access_records_fall_back_to_mtime(open_disk, tmp_path):
    c = make_chunks(4)
    tier = open_disk(3 * OBJ)
    tier.store(c.objs[:3])
    tier.close()
    (tmp_path / "disk" / "kvtier-v1" / "access.log").unlink()
    now = time.time()
    for i, age in enumerate((10, 30, 20)):  # 1 is oldest, then 2, then 0
        os.utime(tier.dir.path(c.keys[i]), (now - age, now - age))
    tier = open_disk(3 * OBJ)
    tier.store([c.objs[3]])
    assert _present(tier, c.keys) == [0, 2, 3]


def test_restart_with_smaller_capacity_evicts_down_to_it(open_disk, metrics):
    c = make_chunks(6)
    tier = open_disk(6 * OBJ)
    tier.store(c.objs)
    tier.close()
    tier = open_disk(3 * OBJ)
    s = tier.stats()
    assert s.used_bytes <= 3 * OBJ and s.objects == 3
    assert _present(tier, c.keys) == [3, 4, 5]
    assert sum(1 for _ in tier.dir.scan()) == 3  # evicted files are gone
    assert metrics.value("kvtier_evicted_chunks_total", tier=tier.name) == 3
    assert _read(tier, c.keys[3:]) == 3


def test_restart_indexes_existing_objects(open_disk):
    c = make_chunks(5)
    tier = open_disk()
    tier.store(c.objs)
    tier.close()
    tier = open_disk()
    assert tier.stats().objects == 5 and tier.stats().used_bytes == 5 * OBJ
    assert tier.lookup(c.keys) == 5


def test_a_second_owner_of_the_directory_is_refused(open_disk):
    tier = open_disk()
    with pytest.raises(ConfigError) as exc:
        open_disk()
    assert "path" in exc.value.key and "Fix:" in str(exc.value)
    assert "shared" in str(exc.value)  # the fix names the right tool
    tier.close()
    open_disk()  # released on close


def test_orphaned_temp_files_are_swept_on_start(open_disk, tmp_path):
    tier = open_disk()
    tier.close()
    tmp = tier.dir.tmp
    leftovers = [f"{HOST}.999999999.abcd.tmp", f"otherhost.{os.getpid()}.ef01.tmp", "garbage"]
    for name in leftovers:
        (tmp / name).write_bytes(b"partial")
        os.utime(tmp / name, (time.time() - 5, time.time() - 5))
    open_disk()
    assert os.listdir(tmp) == []  # the owner knows every temp file is an orphan


def test_stats_and_lookup_follow_a_file_removed_behind_the_tiers_back(open_disk):
    c = make_chunks(3)
    tier = open_disk()
    tier.store(c.objs)
    os.unlink(tier.dir.path(c.keys[1]))
    assert _read(tier, c.keys) == 1  # the miss is discovered on read
    assert tier.lookup(c.keys) == 1
    assert tier.stats().objects == 2 and tier.stats().used_bytes == 2 * OBJ


def test_an_object_larger_than_capacity_is_refused(open_disk, metrics):
    from kvtier.codec import encode
    from tests.support import DTYPE

    tier = open_disk(OBJ)
    key = make_chunks(1).keys[0]
    big = encode(key, DTYPE, (3, 2048), bytes(3 * 4096))
    assert tier.store([big]) == 0
    assert tier.stats().used_bytes == 0
    assert metrics.value("kvtier_dropped_saves_total", tier=tier.name, reason="capacity") == 1


@pytest.mark.parametrize("window", [1, OBJ, 3 * OBJ])
def test_reads_in_a_small_window_still_come_in_order(open_disk, window):
    c = make_chunks(9)
    tier = open_disk(read_window_bytes=window, io_threads=3)
    tier.store(c.objs)
    assert _read(tier, c.keys) == 9


@pytest.mark.parametrize("o_direct", [True, False])
def test_reads_with_and_without_o_direct(open_disk, o_direct):
    c = make_chunks(3)
    tier = open_disk(o_direct=o_direct, cold_reads=True)
    tier.store(c.objs)
    bufs = [bytearray(len(payload_for(k))) for k in c.keys]
    assert tier.load(c.keys, bufs) == 3
    assert [bytes(b) for b in bufs] == c.payloads


def test_a_failing_directory_trips_the_breaker_and_is_skipped(tmp_path, metrics, monkeypatch):
    clock = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown_s=5.0, clock=lambda: clock[0])
    tier = DiskTier(disk_config(tmp_path / "disk"), metrics, breaker)
    c = make_chunks(4)
    calls = []
    real = ObjectDir.write

    def failing(self, obj, key, fsync):
        calls.append(key)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ObjectDir, "write", failing)
    assert tier.store(c.objs[:1]) == 0
    assert tier.store(c.objs[:1]) == 0
    assert breaker.state == "open"
    assert tier.store(c.objs) == 0
    assert len(calls) == 2  # skipped while open: no backend call
    assert tier.lookup(c.keys) == 0  # answered from the index, no I/O
    assert metrics.value("kvtier_dropped_saves_total", tier=tier.name, reason="breaker_open") == 4
    assert metrics.value("kvtier_breaker_open", tier=tier.name) == 1
    assert tier.stats().used_bytes == 0  # failed writes release their room

    monkeypatch.setattr(ObjectDir, "write", real)
    clock[0] = 5.0  # cooled down: one probe goes through and closes it
    assert tier.store(c.objs) == 4
    assert breaker.state == "closed"
    assert metrics.value("kvtier_breaker_open", tier=tier.name) == 0
    assert tier.lookup(c.keys) == 4
    tier.close()
