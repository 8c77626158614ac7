"""Case 14: a restart on a store written by an older format version or for
another model.

Other namespaces' objects (another model, an older format version, whose
namespace digest differs) are never served: their keys differ. An object of
an older format version found under a current key's name is refused, counted
and quarantined. Stray names (an older layout folder, non-hex names, junk
files) neither crash the start nor get served. Capacity still holds: the
disk tier counts every object it finds and evicts the foreign ones first
(they are never read); the shared tier's collector counts and collects them.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib

import pytest

from kvtier.codec import HEADER_BLOCK, HEADER_STRUCT_SIZE
from kvtier.keys import chunk_keys
from kvtier.metrics import Metrics
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.shared import SharedTier
from kvtier.version import FORMAT_VERSION
from tests.support import NS, OBJ, disk_config, obj_for, objs_for, payload_for, shared_config, tokens_for

OTHER_MODEL = dataclasses.replace(NS, model="test/older-model", model_fingerprint="sha256:ff")
OLD_FORMAT = dataclasses.replace(NS, format_version=0)
TOKENS = [tokens_for(900 + s, 3 * NS.chunk_tokens) for s in range(8)]


def _with_version(data: bytes, version: int) -> bytes:
    head = bytearray(data[: HEADER_STRUCT_SIZE - 4])
    struct.pack_into("<H", head, 8, version)
    return bytes(head) + struct.pack("<I", zlib.crc32(head)) + data[HEADER_STRUCT_SIZE:]


def _fill_with_foreign_objects(open_tier, root) -> tuple[list, list]:
    """Write what an older kvtier or another model left: 16 objects of
    another model, 8 of an older format version (header version 0 too), an
    older layout folder and junk names. Returns (foreign keys, stray paths)."""
    tier = open_tier(64 * OBJ)
    foreign = [k for toks in TOKENS[:6] for k in chunk_keys(OTHER_MODEL, toks)][:16]
    assert tier.store(objs_for(foreign)) == 16
    old = [k for toks in TOKENS[6:] for k in chunk_keys(OLD_FORMAT, toks)][:6]
    for k in old:
        path = tier.dir.path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_with_version(bytes(obj_for(k).buf), 0))
    tier.close()
    base = root / "kvtier-v1" / "objects"
    strays = [
        root / "kvtier-v0" / "objects" / "ab" / ("ab" * 32 + ".kvc"),  # an older layout: not ours to read or delete
        base / "not-hex-namespace" / "ab" / ("ab" * 32 + ".kvc"),
        base / "0123456789abcdef" / "zz" / "zz-not-a-key.kvc",
        base / "0123456789abcdef" / "README",
    ]
    for p in strays:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 100)
    return foreign + old, strays


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_restart_on_another_models_and_an_older_formats_store(tmp_path, kind):
    root = tmp_path / kind
    metrics = Metrics()

    def open_tier(capacity):
        if kind == "disk":
            return DiskTier(disk_config(root, capacity), metrics)
        return SharedTier(shared_config(root, capacity, high_watermark=0.9, low_watermark=0.5), metrics)

    foreign, strays = _fill_with_foreign_objects(open_tier, root)
    capacity = 12 * OBJ  # less than the 22 foreign objects on disk
    tier = open_tier(capacity)
    try:
        if kind == "shared":
            tier.gc()
        assert tier.stats().used_bytes <= capacity
        mine = [chunk_keys(NS, toks) for toks in TOKENS]
        for keys in mine:  # the same prompts, this model: nothing of the old store is served
            assert tier.lookup(keys) == 0
            assert list(tier.fetch(keys)) == []
        for keys in mine:
            tier.store(objs_for(keys))
            if kind == "shared":
                tier.gc()
            assert tier.stats().used_bytes <= capacity
        on_disk = sum(e.size for e in tier.dir.scan())
        assert on_disk <= capacity, f"{on_disk} B of objects, capacity {capacity}"
        assert tier.lookup(mine[-1]) == 3 and [bytes(o.payload) for o in tier.fetch(mine[-1])] == [
            payload_for(k) for k in mine[-1]]
    finally:
        tier.close()
    for p in strays:
        assert p.read_bytes() == b"x" * 100, f"{p} was touched"


@pytest.mark.parametrize("kind", ["disk", "shared"])
def test_an_older_format_object_under_a_current_name_is_refused(tmp_path, kind):
    root = tmp_path / kind
    metrics = Metrics()
    opener = (lambda: DiskTier(disk_config(root), metrics)) if kind == "disk" else (lambda: SharedTier(shared_config(root), metrics))
    keys = chunk_keys(NS, TOKENS[0])
    tier = opener()
    tier.store(objs_for(keys))
    tier.close()
    for version in (FORMAT_VERSION - 1, FORMAT_VERSION + 1):  # older, and newer than this reader
        path = tier.dir.path(keys[1])
        path.write_bytes(_with_version(bytes(obj_for(keys[1]).buf), version))
        tier = opener()  # restart: the disk tier indexes it like any object
        try:
            assert [bytes(o.payload) for o in tier.fetch(keys)] == [payload_for(keys[0])]
            assert not path.exists() and os.listdir(tier.dir.quarantine_dir)
        finally:
            tier.close()
        tier.dir.path(keys[1]).write_bytes(bytes(obj_for(keys[1]).buf))
    assert metrics.value("kvtier_integrity_failures_total", tier=kind) == 2
