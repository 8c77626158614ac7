"""Case 13: the disk and shared tiers on a full file system.

Each tier gets a tmpfs of 256 KiB (the test mounts it; we run as root),
while its configured capacity is larger: the file system fills first, as
when other users share the volume or a quota is hit. Saves must be dropped
and counted (``no_space``), loads of what is stored must keep working (the
breaker must not treat a full disk as a dead one), nothing stored may be
damaged, no temp file may be left, saves must resume once there is room,
and a restart on the full file system must work.
"""

from __future__ import annotations

import os

import pytest

from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers import disk as disk_mod
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.shared import SharedTier
from kvtier.admin.dirstore import verify_objects
from tests.support import DTYPE, OBJ, disk_config, keys_for, memory_config, objs_for, payload_for, shape_for, shared_config

FS_SIZE = "256k"
SESSIONS = 20  # 20 x 3 objects x 8 KiB: far more than 256 KiB
CHUNKS = 3


def _open(kind, path, metrics):
    if kind == "disk":
        return DiskTier(disk_config(path, 256 * OBJ), metrics)
    return SharedTier(shared_config(path, 256 * OBJ), metrics)


def _fetch_ok(tier, keys) -> int:
    n = 0
    for obj in tier.fetch(keys):
        try:
            assert bytes(obj.payload) == payload_for(keys[n])
        finally:
            obj.release()
        n += 1
    return n


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_full_file_system_drops_saves_and_keeps_serving_loads(small_fs, metrics, monkeypatch, kind):
    monkeypatch.setattr(disk_mod, "_FLUSH_S", 0.0)  # the access log writes on every access
    root = small_fs.mount(kind, FS_SIZE)
    tier = _open(kind, root, metrics)
    sessions = [keys_for(3000 + s, CHUNKS) for s in range(SESSIONS)]
    stored = [tier.store(objs_for(keys)) for keys in sessions]
    assert stored[0] == CHUNKS, "the file system was full from the start"
    assert min(stored) < CHUNKS, "the file system never filled"
    assert metrics.value("kvtier_dropped_saves_total", tier=tier.name, reason="no_space") > 0

    # Loads of everything that was stored still work, again and again.
    whole = [keys for keys, n in zip(sessions, stored) if n == CHUNKS]
    for _ in range(3):
        for keys in whole:
            assert tier.lookup(keys) == CHUNKS
            assert _fetch_ok(tier, keys) == CHUNKS
    assert tier.breaker.state == "closed"
    assert metrics.value("kvtier_breaker_open", tier=tier.name) == 0

    # Nothing damaged, nothing half-written left behind.
    report = verify_objects(tier.dir, list(tier.dir.scan()), quarantine=False)
    assert report.bad == [] and report.ok >= len(whole) * CHUNKS
    assert os.listdir(tier.dir.tmp) == []

    # Room again: saves resume.
    tier.delete([k for keys in whole[: len(whole) // 2 + 1] for k in keys])
    late = keys_for(3999, CHUNKS)
    assert tier.store(objs_for(late)) == CHUNKS
    assert _fetch_ok(tier, late) == CHUNKS
    tier.close()


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_a_restart_on_a_full_file_system_serves_what_is_there(small_fs, metrics, kind):
    root = small_fs.mount(kind, FS_SIZE)
    tier = _open(kind, root, metrics)
    sessions = [keys_for(4000 + s, CHUNKS) for s in range(SESSIONS)]
    stored = [tier.store(objs_for(keys)) for keys in sessions]
    tier.close()
    filler = root / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # whatever room is left: gone
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    again = _open(kind, root, Metrics())
    try:
        whole = [keys for keys, n in zip(sessions, stored) if n == CHUNKS]
        assert whole
        for keys in whole:
            assert _fetch_ok(again, keys) == CHUNKS
    finally:
        again.close()


def test_a_tiered_store_keeps_serving_from_a_full_disk(small_fs):
    """Write-through drops are counted per tier; the memory tier and the full
    disk tier both keep serving."""
    metrics = Metrics()
    root = small_fs.mount("stack", FS_SIZE)
    cfg = StoreConfig(tiers=(TierSpec("memory", memory_config(8 * OBJ)),
                             TierSpec("disk", disk_config(root / "disk", 256 * OBJ))))
    sessions = [keys_for(5000 + s, CHUNKS) for s in range(SESSIONS)]
    with TieredStore(cfg, metrics) as store:
        for keys in sessions:
            store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
            assert store.flush(10)
        assert metrics.value("kvtier_dropped_saves_total", tier="disk", reason="no_space") > 0
        served = 0
        for keys in sessions:
            bufs = [bytearray(len(payload_for(k))) for k in keys]
            n = store.load(keys, bufs)
            assert [bytes(b) for b in bufs[:n]] == [payload_for(k) for k in keys[:n]]
            served += n
        assert served >= CHUNKS * 4
        assert store.tier("disk").breaker.state == "closed"
