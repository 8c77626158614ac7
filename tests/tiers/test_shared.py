"""Shared tier specifics: verification and quarantine, watermark collection,
check-before-write, access stamps, and many processes on one directory."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from kvtier.buffers import alloc
from kvtier.codec import HEADER_BLOCK, ChunkObject, encode
from kvtier.metrics import Metrics
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.dir.filewrite import PendingWrite, _direct_writable
from kvtier.tiers.dir.layout import HOST
from kvtier.tiers.shared import SharedTier
from tests.support import DTYPE, OBJ, assert_object, keys_for, make_chunks, shared_config
from tests.tiers import shared_worker

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(shared_worker.__file__)


@pytest.fixture
def open_shared(tmp_path):
    opened = []

    def open_(capacity=64 * OBJ, metrics=None, **kw):
        t = SharedTier(shared_config(tmp_path / "shared", capacity, **kw), metrics)
        opened.append(t)
        return t

    yield open_
    for t in opened:
        t.close()


def _read(tier, keys) -> int:
    n = 0
    for obj in tier.fetch(keys):
        assert_object(obj, keys[n])
        n += 1
    return n


def _present(tier, keys):
    return [i for i, k in enumerate(keys) if tier.lookup([k])]


# ---------------------------------------------------------------- lookup


@pytest.mark.parametrize("check_s", [None, 1e-3, 150e-6, 1e-6])  # untimed, a round trip, a few per job, one job
@pytest.mark.parametrize("missing", [None, 0, 3, 4, 11])
def test_lookup_jobs_follow_the_checks_time_and_the_answer_does_not(open_shared, monkeypatch, check_s, missing):
    tier = open_shared()
    c = make_chunks(12)
    tier.store(c.objs)
    if missing is not None:
        tier.delete([c.keys[missing]])
    monkeypatch.setattr(tier, "_check_s", check_s)
    jobs = []
    submit = tier.executor.submit
    monkeypatch.setattr(tier.executor, "submit", lambda prio, fn, *a: jobs.append(a) or submit(prio, fn, *a))
    assert tier.lookup(c.keys) == (12 if missing is None else missing)
    run = {None: 1, 1e-3: 1, 150e-6: 3, 1e-6: 12}[check_s]
    assert [len(a[0]) for a in jobs] == [min(run, 12 - i) for i in range(0, 12, run)]


def test_lookup_times_its_checks(open_shared):
    tier = open_shared()
    c = make_chunks(4)
    tier.store(c.objs)
    assert tier._check_s is None
    assert tier.lookup(c.keys) == 4
    assert tier._check_s is not None and 0 < tier._check_s < 1.0


# ---------------------------------------------------------------- verification


def _flip_payload(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(HEADER_BLOCK + 100)
        b = f.read(1)
        f.seek(HEADER_BLOCK + 100)
        f.write(bytes([b[0] ^ 0x40]))


def _flip_header(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0x01]))


def _truncate(p: Path) -> None:
    os.truncate(p, HEADER_BLOCK + 100)


def _zero_length(p: Path) -> None:
    os.truncate(p, 0)


def _wrong_version(p: Path) -> None:
    b = bytearray(p.read_bytes())
    struct.pack_into("<H", b, 8, 99)
    struct.pack_into("<I", b, 212, zlib.crc32(bytes(b[:212])))
    p.write_bytes(bytes(b))


CORRUPTIONS = {
    "flipped-payload-byte": _flip_payload,
    "flipped-header-byte": _flip_header,
    "truncated": _truncate,
    "zero-length": _zero_length,
    "wrong-version": _wrong_version,
}


@pytest.mark.parametrize("read", [{}, {"o_direct": True}, {"o_direct": True, "aio": True}],
                         ids=["buffered", "o_direct", "o_direct-aio"])
@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_a_corrupt_object_is_a_miss_counted_and_quarantined(open_shared, corrupt, read):
    metrics = Metrics()
    tier = open_shared(metrics=metrics, **read)
    c = make_chunks(3)
    tier.store(c.objs)
    path = tier.dir.path(c.keys[1])
    original = path.read_bytes()
    CORRUPTIONS[corrupt](path)

    assert _read(tier, c.keys) == 1  # the prefix ends at the bad object
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
    assert not path.exists()
    quarantined = os.listdir(tier.dir.quarantine_dir)
    assert len(quarantined) == 1 and quarantined[0].startswith(c.keys[1].hex + ".")
    assert (tier.dir.quarantine_dir / quarantined[0]).read_bytes() != original
    assert tier.lookup(c.keys) == 1
    assert _read(tier, c.keys) == 1  # no second report: it is gone
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1

    tier.store(c.objs)  # a recompute stores it again, whole
    assert _read(tier, c.keys) == 3


def test_an_object_under_another_keys_name_is_refused(open_shared):
    metrics = Metrics()
    tier = open_shared(metrics=metrics)
    c = make_chunks(2)
    tier.store(c.objs[:1])
    dst = tier.dir.path(c.keys[1])
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(tier.dir.path(c.keys[0]).read_bytes())
    assert _read(tier, c.keys[1:]) == 0
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1


# ---------------------------------------------------------------- collection


def _stamp(tier, keys, ages):
    now = time.time()
    for k, age in zip(keys, ages):
        os.utime(tier.dir.path(k), (now - age, now - age))


def test_gc_deletes_the_least_recently_stamped_until_under_low_watermark(open_shared):
    metrics = Metrics()
    tier = open_shared(10 * OBJ, metrics, high_watermark=0.5, low_watermark=0.3)
    c = make_chunks(8)
    tier.store(c.objs)
    ages = [50, 10, 80, 20, 70, 30, 60, 40]  # newest: 1, 3, 5
    _stamp(tier, c.keys, ages)
    r = tier.gc()
    assert r.ran and (r.objects, r.bytes_before, r.deleted, r.bytes_after) == (8, 8 * OBJ, 5, 3 * OBJ)
    assert _present(tier, c.keys) == [1, 3, 5]
    assert tier.stats().used_bytes == 3 * OBJ and tier.stats().objects == 3
    assert metrics.value("kvtier_evicted_chunks_total", tier=tier.name) == 5
    assert metrics.value("kvtier_used_bytes", tier=tier.name) == 3 * OBJ


def test_gc_below_the_high_watermark_deletes_nothing(open_shared):
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    c = make_chunks(5)
    tier.store(c.objs)  # exactly at the high watermark: not above it
    r = tier.gc()
    assert r.ran and r.deleted == 0 and r.bytes_after == 5 * OBJ
    assert tier.lookup(c.keys) == 5


def test_gc_dry_run_reports_and_deletes_nothing(open_shared):
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    c = make_chunks(8)
    tier.store(c.objs)
    r = tier.gc(dry_run=True)
    assert r.deleted == 5 and r.bytes_after == 3 * OBJ
    assert tier.lookup(c.keys) == 8


def test_gc_sees_objects_written_by_other_instances(open_shared, tmp_path):
    a = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    b = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    c = make_chunks(8)
    b.store(c.objs)
    assert a.stats().used_bytes == 0  # a has not scanned yet
    assert a.gc().deleted == 5
    assert a.stats().used_bytes == 3 * OBJ


def test_a_collector_holding_the_lease_keeps_others_out(open_shared):
    a = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    b = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    c = make_chunks(8)
    a.store(c.objs)
    _stamp(a, c.keys, [50, 10, 80, 20, 70, 30, 60, 40])
    inside, release = threading.Event(), threading.Event()

    def progress(_n):
        inside.set()
        assert release.wait(10)

    result = {}
    t = threading.Thread(target=lambda: result.setdefault("a", a.gc(progress=progress)))
    t.start()
    assert inside.wait(10)
    rb = b.gc()  # a is mid-pass
    release.set()
    t.join(10)
    assert not rb.ran and rb.deleted == 0
    assert result["a"].ran and result["a"].deleted == 5
    assert _present(a, c.keys) == [1, 3, 5]
    assert not (a.dir.base / "gc.lease").exists()
    assert b.gc().ran  # the lease was released


def test_concurrent_collectors_never_delete_more_than_needed(open_shared):
    tiers = [open_shared(40 * OBJ, high_watermark=0.5, low_watermark=0.25) for _ in range(3)]
    c = make_chunks(60)
    rng = random.Random(7)
    for _ in range(5):
        tiers[0].store(c.objs)
        ages = list(range(10, 10 + 60))
        rng.shuffle(ages)
        _stamp(tiers[0], c.keys, ages)
        newest = sorted(range(60), key=lambda i: ages[i])[:10]
        start = threading.Barrier(len(tiers))
        results, errors = [], []

        def run(t):
            try:
                start.wait(5)
                results.append(t.gc())
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in tiers]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert not errors
        assert sum(r.deleted for r in results) == 50
        assert _present(tiers[0], c.keys) == sorted(newest)


def test_a_dead_collectors_lease_is_taken_over(open_shared):
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3)
    tier.store(make_chunks(8).objs)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lease = tier.dir.base / "gc.lease"
    lease.write_text(json.dumps({"host": HOST, "pid": dead.pid, "time": time.time()}))
    assert tier.gc().ran


def test_a_live_collectors_lease_is_respected_until_it_expires(open_shared):
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3, lease_s=600)
    tier.store(make_chunks(8).objs)
    lease = tier.dir.base / "gc.lease"
    lease.write_text(json.dumps({"host": "otherhost", "pid": 1, "time": time.time()}))
    assert not tier.gc().ran
    assert lease.exists()
    lease.write_text(json.dumps({"host": "otherhost", "pid": 1, "time": time.time() - 601}))
    assert tier.gc().ran


def test_a_lease_being_written_is_not_mistaken_for_an_abandoned_one(open_shared):
    # A collector creates the lease (O_EXCL) and writes it in a second step;
    # in between, others read an empty file. Only an old one is abandoned.
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3, lease_s=600)
    tier.store(make_chunks(8).objs)
    lease = tier.dir.base / "gc.lease"
    lease.write_bytes(b"")
    assert not tier.gc().ran
    os.utime(lease, (time.time() - 601, time.time() - 601))
    assert tier.gc().ran


def test_automatic_collection_runs_at_start_and_again_after_the_interval(tmp_path):
    metrics = Metrics()
    tier = SharedTier(shared_config(tmp_path / "s", 4 * OBJ, gc_interval_s=0.3), metrics)
    c = make_chunks(13)
    tier.store(c.objs[:1])  # the first write of an instance starts a pass (it measures usage)
    deadline = time.monotonic() + 10
    while tier._gc_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier._last_gc is not None
    tier.store(c.objs[1:12])  # well over capacity, but the next pass is not due yet
    assert not tier._gc_pending
    time.sleep(0.35)
    tier.store(c.objs[12:])  # due now: one pass starts in the background
    tier.close()  # drains it
    files = {e.key_hex for e in ObjectDir(tmp_path / "s", "path").scan()}
    assert len(files) <= 4 and c.keys[12].hex in files
    assert metrics.value("kvtier_evicted_chunks_total", tier=tier.name) >= 9


def test_concurrent_takeovers_of_a_stale_lease_leave_one_lease(open_shared):
    tier = open_shared(10 * OBJ, high_watermark=0.5, low_watermark=0.3, lease_s=600)
    lease = tier.dir.base / "gc.lease"
    lease.write_text(json.dumps({"host": "otherhost", "pid": 1, "time": time.time() - 601, "token": "old"}))
    tokens, barrier = [], threading.Barrier(8)

    def take():
        barrier.wait()
        tokens.append(tier._take_lease(lease))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [t for t in tokens if t is not None]
    assert len(won) >= 1
    assert json.loads(lease.read_text())["token"] in won  # a whole, fresh lease is in place
    assert not list(tier.dir.tmp.iterdir())  # no lease drafts left behind


# ---------------------------------------------------------------- writes and stamps


def test_check_before_write_skips_objects_already_published(open_shared):
    ma, mb = Metrics(), Metrics()
    a, b = open_shared(metrics=ma), open_shared(metrics=mb)
    c = make_chunks(3)
    assert a.store(c.objs) == 3
    inodes = [os.stat(a.dir.path(k)).st_ino for k in c.keys]
    assert b.store(c.objs) == 3
    assert mb.value("kvtier_store_skipped_chunks_total", tier=b.name) == 3
    assert mb.value("kvtier_written_bytes_total", tier=b.name) == 0
    assert [os.stat(a.dir.path(k)).st_ino for k in c.keys] == inodes  # not rewritten
    assert _read(b, c.keys) == 3


def test_reads_stamp_objects_at_most_once_per_interval(open_shared):
    tier = open_shared(touch_interval_s=60)
    c = make_chunks(2)
    tier.store(c.objs)
    fresh = os.stat(tier.dir.path(c.keys[0])).st_mtime
    _stamp(tier, c.keys[1:], [120])
    stale = os.stat(tier.dir.path(c.keys[1])).st_mtime
    assert _read(tier, c.keys) == 2
    assert tier._owed.settle(5.0)  # stamped once the load's consumer is done
    assert os.stat(tier.dir.path(c.keys[0])).st_mtime == fresh  # stamped recently: left alone
    assert os.stat(tier.dir.path(c.keys[1])).st_mtime > stale + 100


def test_a_collection_waits_for_owed_stamps_unless_it_runs_on_the_only_io_thread(open_shared):
    """Recency is judged on the stamps loads still owe: a pass called from
    any other thread waits for them, also where the tier has one I/O
    thread (which makes them). Only a pass on that thread itself (the
    background collector) cannot wait: the stamps are queued behind it."""
    from kvtier.concurrency.executor import MAINTENANCE

    tier = open_shared(io_threads=1)
    tier._owed.add()
    threading.Timer(0.3, tier._owed.done).start()
    t0 = time.monotonic()
    tier.gc()
    assert time.monotonic() - t0 >= 0.25  # it waited for the stamp
    tier._owed.add()  # made by nobody while the pass runs
    t0 = time.monotonic()
    tier.executor.submit(MAINTENANCE, tier.gc).result(10)
    assert time.monotonic() - t0 < 2.0  # on the only I/O thread: no wait
    tier._owed.done()


@pytest.mark.parametrize("how", ["aio", "pool threads, O_DIRECT", "pool threads, buffered"])
def test_a_load_stamps_objects_through_the_files_it_read_not_their_paths_again(open_shared, monkeypatch, how):
    """A load's stamp is one futimens on the file it has open, whichever
    way it reads: its folders are not walked again (round trips on a
    network file system, between a read landing and its object being
    handed over)."""
    tier = open_shared(touch_interval_s=60, aio=how == "aio", o_direct=how != "pool threads, buffered")
    c = make_chunks(3)
    tier.store(c.objs)
    _stamp(tier, c.keys, [120, 120, 120])
    stale = [os.stat(tier.dir.path(k)).st_mtime for k in c.keys]
    by_path = []
    monkeypatch.setattr(ObjectDir, "touch", lambda self, key, when: by_path.append(key))
    bufs = [memoryview(bytearray(len(p))) for p in c.payloads]
    assert tier.load(c.keys, bufs) == 3
    path = "buffered" if how == "pool threads, buffered" else "direct"
    assert tier.metrics.m.value("kvtier_read_path_loads_total", tier=tier.name, path=path) == 1
    assert tier._owed.settle(5.0)
    assert by_path == []
    assert all(os.stat(tier.dir.path(k)).st_mtime > s + 100 for k, s in zip(c.keys, stale))


@pytest.mark.parametrize("how", ["aio", "pool threads, O_DIRECT", "pool threads, buffered"])
def test_a_load_hands_its_objects_over_before_it_stamps_them(open_shared, monkeypatch, how):
    """A load's recency stamps wait until its consumer is done: a stamp that
    takes long (a round trip to a slow mount) delays no hand-over. The
    stamps are made afterwards, through the files the load read, each
    closed then; a collection pass waits for them."""
    tier = open_shared(touch_interval_s=60, aio=how == "aio", o_direct=how != "pool threads, buffered")
    c = make_chunks(4)
    tier.store(c.objs)
    _stamp(tier, c.keys, [120] * 4)
    stale = [os.stat(tier.dir.path(k)).st_mtime for k in c.keys]
    release = threading.Event()
    stamping = []
    real_utime = os.utime

    def slow_utime(target, *args, **kw):
        if isinstance(target, int):  # a stamp through a read's file
            stamping.append(target)
            release.wait(10)
        return real_utime(target, *args, **kw)

    monkeypatch.setattr(os, "utime", slow_utime)
    fds_before = len(os.listdir("/proc/self/fd"))
    bufs = [memoryview(bytearray(len(p))) for p in c.payloads]
    t0 = time.monotonic()
    assert tier.load(c.keys, bufs) == 4
    assert time.monotonic() - t0 < 5  # not held by the stamps
    assert [bytes(b) for b in bufs] == [bytes(p) for p in c.payloads]
    assert not tier._owed.settle(0.2)  # owed, and the first one is stuck
    # The collection pass waits for them (here they are released meanwhile).
    gc = threading.Thread(target=tier.gc)
    gc.start()
    time.sleep(0.2)
    assert gc.is_alive()
    release.set()
    gc.join(10)
    assert not gc.is_alive() and tier._owed.settle(0)
    assert len(stamping) == 4
    assert all(os.stat(tier.dir.path(k)).st_mtime > s + 100 for k, s in zip(c.keys, stale))
    assert len(os.listdir("/proc/self/fd")) <= fds_before  # every file the stamps held is closed


def test_a_tier_reads_with_threads_only_after_aio_loads_in_a_row_spent_most_of_their_time_opening(open_shared, caplog):
    tier = open_shared()
    assert tier._aio_ok
    tier._aio_timed(0.009, 0.010)
    tier._aio_timed(0.0009, 0.001)  # too short to tell: neither counts nor resets
    tier._aio_timed(0.009, 0.010)
    tier._aio_timed(0.002, 0.010)  # mostly waiting for the device: starts over
    tier._aio_timed(0.009, 0.010)
    tier._aio_timed(0.006, 0.010)
    assert tier._aio_ok
    assert tier.metrics.m.value("kvtier_aio_reads", tier=tier.name) == 1
    tier._aio_timed(0.008, 0.010)
    assert not tier._aio_ok
    assert tier.metrics.m.value("kvtier_aio_reads", tier=tier.name) == 0
    assert sum("AIO loads spent most of their time opening files" in r.getMessage() for r in caplog.records) == 1


def test_aio_loads_from_a_local_disk_stay_on_aio(open_shared, monkeypatch):
    """On a local disk an open and an io_submit take microseconds: loads of
    48 MiB are judged (long enough) and none moves the tier to threads."""
    tier = open_shared(capacity=256 << 20)
    assert tier.dir.direct_ok, "the test directory must take O_DIRECT reads (a real disk, not tmpfs)"
    keys = keys_for(77, 16)
    payloads = [os.urandom(3 << 20) for _ in keys]
    tier.store([encode(k, DTYPE, (1536, 1024), p) for k, p in zip(keys, payloads)])
    timed, real = [], tier._aio_timed
    monkeypatch.setattr(tier, "_aio_timed", lambda s, a: (timed.append((s, a)), real(s, a)))
    bufs = [memoryview(bytearray(3 << 20)) for _ in keys]
    for _ in range(4):
        tier.drop_cache()
        assert tier.load(keys, bufs) == len(keys)
        assert [bytes(b) for b in bufs] == payloads
    assert len(timed) == 4 and any(a >= 0.005 for _, a in timed), timed
    assert all(s < 0.5 * a for s, a in timed if a >= 0.005), timed
    assert tier._aio_ok


def test_a_skipped_store_stamps_the_existing_object(open_shared):
    tier = open_shared(touch_interval_s=60)
    c = make_chunks(1)
    tier.store(c.objs)
    _stamp(tier, c.keys, [120])
    stale = os.stat(tier.dir.path(c.keys[0])).st_mtime
    tier.store(c.objs)
    assert os.stat(tier.dir.path(c.keys[0])).st_mtime > stale + 100


def test_start_sweeps_dead_writers_and_old_files_only(tmp_path):
    d = ObjectDir(tmp_path / "s", "path")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 7200
    names = {
        f"{HOST}.{dead.pid}.aa.tmp": None,  # this host, writer gone: swept
        f"{HOST}.{os.getpid()}.bb.tmp": None,  # this host, writer alive: kept
        f"otherhost.{dead.pid}.cc.tmp": None,  # another host, fresh: kept
        f"otherhost.{os.getpid()}.dd.tmp": old,  # another host, old: swept
    }
    for name, mtime in names.items():
        (d.tmp / name).write_bytes(b"x")
        if mtime:
            os.utime(d.tmp / name, (mtime, mtime))
    SharedTier(shared_config(tmp_path / "s")).close()
    assert sorted(os.listdir(d.tmp)) == sorted([f"{HOST}.{os.getpid()}.bb.tmp", f"otherhost.{dead.pid}.cc.tmp"])


def test_layout_names_hold_only_digests_and_are_private(open_shared):
    tier = open_shared()
    c = make_chunks(1)
    tier.store(c.objs)
    p = tier.dir.path(c.keys[0])
    rel = p.relative_to(tier.dir.root)
    assert rel.parts == ("kvtier-v1", "objects", c.keys[0].ns[:8].hex(), c.keys[0].hex[:2], c.keys[0].hex + ".kvc")
    assert p.stat().st_mode & 0o777 == 0o600
    for d in (tier.dir.base, tier.dir.objects, tier.dir.tmp, tier.dir.quarantine_dir, p.parent, p.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700


# ---------------------------------------------------------------- many processes


def _worker(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _verify_directory(root: Path, keys, only=None) -> int:
    """Every published object under ``root`` (or those of the keys in
    ``only``) verifies against its key."""
    by_hex = {k.hex: k for k in keys}
    d = ObjectDir(root, "path")
    n = 0
    for e in d.scan():
        key = by_hex[e.key_hex]  # no object under a name nobody wrote
        if only is not None and key not in only:
            continue
        obj, _ = d.read(key, o_direct=False, cold=False)  # raises CorruptObject if not whole
        assert bytes(obj.payload) == shared_worker.payload(key, obj.header.payload_len)
        n += 1
    return n


def test_three_processes_share_one_directory_without_torn_reads(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()  # the mount point: a shared tier's folder must exist
    procs = [_worker("mix", str(root), "2.5", str(seed)) for seed in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    for r in results:
        assert r["errors"] == [] and r["io_errors"] == 0, r
        assert r["mismatches"] == 0, r
        assert r["integrity_failures"] == 0, r  # a torn read would show up here
        assert r["writes"] > 0 and r["hits"] > 0, r
    assert sum(r["gc_runs"] for r in results) > 0
    assert _verify_directory(root, shared_worker.mix_keys()) > 0
    d = ObjectDir(root, "path")
    assert os.listdir(d.quarantine_dir) == []
    assert os.listdir(d.tmp) == []


def test_a_writer_killed_mid_write_leaves_nothing_partial(tmp_path):
    root = tmp_path / "shared"
    d = ObjectDir(root, "path")
    rng = random.Random(11)
    keys, left_behind = [], 0
    for seed in range(10):
        p = _worker("writer", str(root), str(seed))
        try:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rng.uniform(0.02, 0.15))
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(30)
        mine = shared_worker.big_keys(seed)
        keys += mine
        left_behind += sum(1 for f in os.listdir(d.tmp) if f.startswith(f"{HOST}.{p.pid}."))
        _verify_directory(root, keys, only=set(mine))  # what it published is whole, or absent
    assert left_behind > 0, "no writer was killed mid-write; the test proved nothing"
    SharedTier(shared_config(root)).close()  # the next start sweeps dead writers' files
    assert os.listdir(d.tmp) == []
    assert _verify_directory(root, keys) > 0


def test_sweep_tmp_removes_a_killed_writers_files(tmp_path):
    root = tmp_path / "shared"
    d = ObjectDir(root, "path")
    for attempt in range(10):
        p = _worker("writer", str(root), str(100 + attempt))
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(0.05)
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait(30)
        orphans = [f for f in os.listdir(d.tmp) if f.startswith(f"{HOST}.{p.pid}.")]
        if orphans:
            break
    assert orphans, "never caught a writer mid-write"
    assert d.sweep_tmp(3600) == len(orphans)  # young, but its writer is dead
    assert os.listdir(d.tmp) == []


def _writes(tier, monkeypatch) -> list[bool]:
    """Whether each write's temp file is open with O_DIRECT, as the kernel
    says (F_GETFL) just before it is filled."""
    import fcntl

    seen, fill = [], PendingWrite.fill

    def spy(self, obj, fsync):
        seen.append(bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_DIRECT))
        return fill(self, obj, fsync)

    monkeypatch.setattr(PendingWrite, "fill", spy)
    return seen


def test_objects_are_written_with_o_direct_where_their_buffers_allow_and_read_back_the_same(open_shared,
                                                                                           monkeypatch):
    """Written with O_DIRECT, an object's blocks are placed as it is
    written, on their own aligned run, not packed with other objects' at
    writeback (cold 2k loads here 3-18 % faster,
    docs/benchmarks.md). Objects kvtier builds sit in page-aligned buffers of
    whole pages; any other buffer is written buffered, as is every object
    with ``direct_writes: false``."""
    tier = open_shared()
    seen = _writes(tier, monkeypatch)
    c = make_chunks(4)
    assert tier.store(c.objs) == 4
    assert seen == [True] * 4
    for key, obj in zip(c.keys, tier.fetch(c.keys)):
        assert_object(obj, key)
        obj.release()
    # Buffers an O_DIRECT write cannot take as they are: read-only, off a
    # page boundary, not whole pages.
    aligned = alloc(8192)
    assert _direct_writable(aligned)
    assert not _direct_writable(memoryview(bytes(8192)))
    assert not _direct_writable(memoryview(bytearray(8192 + 4096))[1:8193])
    assert not _direct_writable(aligned[:4000])
    off = make_chunks(1, seed=9)
    key, obj = off.keys[0], off.objs[0]
    copy = ChunkObject(obj.header, memoryview(bytes(obj.buf)))  # read-only
    assert tier.store([copy]) == 1 and seen[-1] is False
    [got] = list(tier.fetch([key]))
    assert_object(got, key)
    got.release()
    plain = open_shared(direct_writes=False)
    seen.clear()
    assert plain.store(make_chunks(2, seed=3).objs) == 2 and seen == [False, False]


def test_a_file_system_that_refuses_o_direct_writes_is_written_buffered_with_one_warning(open_shared, monkeypatch,
                                                                                         caplog):
    """Some file systems refuse O_DIRECT at open, others at the write
    (EINVAL), as with reads: the object is written whole all the same, the
    directory is written buffered from then on, and one warning says so."""
    import errno

    tier = open_shared()
    seen = _writes(tier, monkeypatch)
    real_pwrite = os.pwrite

    def refusing(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    c = make_chunks(3)
    with caplog.at_level("WARNING"):
        assert tier.store(c.objs) == 3
    assert seen == [True, False, False] and not tier.dir.direct_writes
    assert sum("writing it buffered from now on" in r.getMessage() for r in caplog.records) == 1
    for key, obj in zip(c.keys, tier.fetch(c.keys)):
        assert_object(obj, key)
        obj.release()
    # Refused at open: the temp file opens without O_DIRECT.
    other = open_shared()
    seen.clear()
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT and str(path).endswith(".tmp"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    d = make_chunks(2, seed=5)
    assert other.store(d.objs) == 2 and seen == [False, False] and not other.dir.direct_writes
    for key, obj in zip(d.keys, other.fetch(d.keys)):
        assert_object(obj, key)
        obj.release()


def test_a_short_o_direct_write_finishes_that_object_buffered_and_keeps_o_direct_for_the_next(open_shared,
                                                                                              monkeypatch):
    """After a short write the rest of the object is off a page boundary,
    which O_DIRECT refuses (EINVAL): that file goes on buffered and is
    written whole; the directory is not marked as refusing O_DIRECT."""
    import errno
    import fcntl

    tier = open_shared()
    seen = _writes(tier, monkeypatch)
    real_pwrite = os.pwrite

    def short_then_refused(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if offset:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, memoryview(data)[:4096], offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short_then_refused)
    c = make_chunks(2)
    assert tier.store(c.objs) == 2
    assert seen == [True, True] and tier.dir.direct_writes
    for key, obj in zip(c.keys, tier.fetch(c.keys)):
        assert_object(obj, key)
        obj.release()
