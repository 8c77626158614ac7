"""An attacker who can write a tier's medium, but holds no cluster key,
cannot make a store serve KV: forged, replayed, spliced and tampered objects
are misses, counted by reason, and the rest of the prompt is recomputed.

The attacker knows docs/format.md: every object it plants is well formed,
with a right payload checksum and header CRC, so only the seal stands
between it and the engines. Run on the disk, shared, node memory (shm),
Redis and a third-party (SQLite, examples/sqlite_tier) tier, each against
its real medium (files, a real redis-server, a database file).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import redis

from kvtier import auth
from kvtier.codec import HEADER_BLOCK, encode, parse_header
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers.redis.config import RedisConfig
from kvtier.tiers.shm import ShmConfig
from tests.support import DTYPE, disk_config, keys_for, payload_for, rechecksum, shape_for, shared_config
from tests.tiers.redisserver import RedisServer


class Medium:
    """Where a tier keeps its objects, as an attacker sees it: raw bytes
    under the name a reader looks for."""

    kind: str

    def spec(self) -> TierSpec: ...

    def put(self, store: TieredStore, key, data: bytes) -> None: ...

    def get(self, store: TieredStore, key) -> bytes: ...

    def close(self) -> None:
        pass


class Files(Medium):
    def __init__(self, kind: str, root: Path):
        self.kind, self.root = kind, root

    def spec(self):
        if self.kind == "disk":
            return TierSpec("disk", disk_config(self.root))
        if self.kind == "shm":
            return TierSpec("shm", ShmConfig(capacity=1 << 24, path=str(self.root), touch_interval_s=0.0))
        self.root.mkdir(parents=True, exist_ok=True)
        return TierSpec("shared", shared_config(self.root))

    def put(self, store, key, data):
        path = store.tier(self.kind).dir.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def get(self, store, key):
        return store.tier(self.kind).dir.path(key).read_bytes()


class Redis(Medium):
    kind = "redis"

    def __init__(self, root: Path):
        self.server = RedisServer(root)
        self.raw = redis.Redis(host="127.0.0.1", port=self.server.port)

    def spec(self):
        return TierSpec("redis", RedisConfig(address=self.server.address, capacity=1 << 24, io_threads=2))

    def put(self, store, key, data):
        self.raw.set(store.tier("redis").object_name(key), data)

    def get(self, store, key):
        return self.raw.get(store.tier("redis").object_name(key))

    def close(self):
        self.server.stop()


class Sqlite(Medium):
    """A tier from outside kvtier (examples/sqlite_tier, opened by import
    path): the store checks the seals of every persistent tier's objects."""

    kind = "sqlite"

    def __init__(self, root: Path):
        from tests.tiers import harness_sqlite  # noqa: F401  (puts the example on sys.path)

        root.mkdir(parents=True)
        self.db = str(root / "kv.db")

    def spec(self):
        from kvtier.config import parse_tier

        return parse_tier({"kind": "kvtier_sqlite:SqliteTier", "path": self.db, "capacity": "16MiB",
                           "name": "sqlite"}, "tiers[0]")

    def put(self, store, key, data):
        import sqlite3

        with sqlite3.connect(self.db) as db:
            db.execute("UPDATE objects SET data = ?, size = ? WHERE digest = ?", (data, len(data), key.digest))
            if not db.total_changes:
                db.execute("INSERT INTO objects (digest, data, size, seq) VALUES (?, ?, ?, 0)",
                           (key.digest, data, len(data)))

    def get(self, store, key):
        import sqlite3

        with sqlite3.connect(self.db) as db:
            return db.execute("SELECT data FROM objects WHERE digest = ?", (key.digest,)).fetchone()[0]


MEDIUMS = {"disk": lambda p: Files("disk", p), "shared": lambda p: Files("shared", p),
           "shm": lambda p: Files("shm", p), "redis": Redis, "sqlite": Sqlite}


@pytest.fixture(params=sorted(MEDIUMS))
def medium(request, tmp_path):
    m = MEDIUMS[request.param](tmp_path / request.param)
    yield m
    m.close()


def _store(medium: Medium, key_file: str | None, metrics: Metrics) -> TieredStore:
    return TieredStore(StoreConfig(tiers=(medium.spec(),), auth_key_file=key_file or ""), metrics)


def _save(store: TieredStore, keys) -> None:
    store.save(keys, [payload_for(k) for k in keys], DTYPE, [shape_for(k.num_tokens) for k in keys])
    assert store.flush(10)


def _load(store: TieredStore, keys) -> int:
    """Leading chunks served; every one served must be the genuine payload."""
    bufs = [bytearray(len(payload_for(k))) for k in keys]
    n = store.load(keys, bufs)
    assert [bytes(b) for b in bufs[:n]] == [payload_for(k) for k in keys[:n]]
    return n


def _served(store: TieredStore, keys) -> list[bytes]:
    bufs = [bytearray(len(payload_for(k))) for k in keys]
    return [bytes(b) for b in bufs[: store.load(keys, bufs)]]


def _failures(metrics: Metrics, tier: str, reason: str) -> float:
    return metrics.value("kvtier_auth_failures_total", tier=tier, reason=reason)


def test_without_a_key_a_forged_object_is_served(medium, tmp_path):
    """The threat itself: with no key, whoever writes the medium decides what
    is served (why a shared tier warants a key; docs/security.md)."""
    metrics = Metrics()
    keys = keys_for(3, 2)
    with _store(medium, None, metrics) as store:
        _save(store, keys[:1])
        evil = os.urandom(len(payload_for(keys[1])))
        medium.put(store, keys[1], bytes(encode(keys[1], DTYPE, shape_for(keys[1].num_tokens), evil).buf))
        assert _served(store, keys) == [payload_for(keys[0]), evil]


def test_a_forged_object_is_a_miss_counted_as_unsealed(medium, key_file):
    metrics = Metrics()
    keys = keys_for(3, 3)
    with _store(medium, key_file, metrics) as store:
        _save(store, keys[:1])
        evil = os.urandom(len(payload_for(keys[1])))
        medium.put(store, keys[1], bytes(encode(keys[1], DTYPE, shape_for(keys[1].num_tokens), evil).buf))
        assert _load(store, keys) == 1
        assert _failures(metrics, medium.kind, auth.UNSEALED) >= 1
        # The forgery is gone from the tier: the recomputed chunk takes its place.
        assert store.lookup(keys).chunks == 1
        _save(store, keys)
        assert _load(store, keys) == 3


def test_an_object_sealed_with_another_key_is_a_miss(medium, key_file, tmp_path):
    """The attacker seals with a key of its own: not one the cluster holds."""
    metrics = Metrics()
    keys = keys_for(4, 2)
    other = str(tmp_path / "attacker.key")
    auth.write_key_file(other, [auth.new_key()])
    with _store(medium, other, Metrics()) as attacker:
        attacker.save(keys, [os.urandom(len(payload_for(k))) for k in keys], DTYPE,
                      [shape_for(k.num_tokens) for k in keys])
        assert attacker.flush(10)
    with _store(medium, key_file, metrics) as store:
        assert _load(store, keys) == 0
        assert _failures(metrics, medium.kind, auth.UNKNOWN_KEY) >= 1
        # Left in place: it may be a peer's, sealed with a key this node's
        # file does not hold yet (a rotation under way).
        assert store.lookup(keys).chunks == 2


def test_a_seal_copied_from_a_genuine_object_does_not_cover_other_bytes(medium, key_file):
    """Forged payload under a genuine object's key id, nonce and tag (and
    right checksums): the tag does not match."""
    metrics = Metrics()
    keys = keys_for(5, 2)
    with _store(medium, key_file, metrics) as store:
        _save(store, keys)
        data = bytearray(medium.get(store, keys[1]))
        n = parse_header(bytes(data[:4096])).payload_len
        data[HEADER_BLOCK : HEADER_BLOCK + n] = os.urandom(n)
        medium.put(store, keys[1], rechecksum(data))
        assert _load(store, keys) == 1
        assert _failures(metrics, medium.kind, auth.BAD_SEAL) >= 1


@pytest.mark.parametrize("attack", ["tampered", "spliced", "replayed", "resealed_header"])
def test_a_changed_genuine_object_is_a_miss_and_counted(medium, key_file, attack):
    """tampered: one payload bit flipped; spliced: the header of one chunk
    with the payload of another; replayed: a whole genuine object copied
    under another chunk's name; resealed_header: the token count changed.
    Checksums fixed each time, as an attacker would."""
    metrics = Metrics()
    keys = keys_for(6, 3)
    with _store(medium, key_file, metrics) as store:
        _save(store, keys)
        assert _load(store, keys) == 3
        genuine = [bytearray(medium.get(store, k)) for k in keys]
        target = genuine[1]
        if attack == "tampered":
            target[HEADER_BLOCK + 10] ^= 0x01
            forged = rechecksum(target)
        elif attack == "spliced":
            forged = rechecksum(target[:HEADER_BLOCK] + genuine[2][HEADER_BLOCK:])
        elif attack == "replayed":
            forged = bytes(genuine[2])
        else:
            struct.pack_into("<I", target, 184, keys[1].num_tokens - 1)
            forged = rechecksum(target)
        medium.put(store, keys[1], forged)
        if store.memory is not None and store.memory is not store.tier(medium.kind):
            store.memory.clear()
        assert _load(store, keys) == 1
        # A replayed object names another key: the tier's own check refuses
        # it (integrity); everything else passes the checksums the attacker
        # fixed, and only the seal refuses it.
        if attack in ("replayed", "resealed_header"):
            assert metrics.value("kvtier_integrity_failures_total", tier=medium.kind) >= 1
        else:
            assert _failures(metrics, medium.kind, auth.BAD_SEAL) >= 1
        _save(store, keys)  # the recomputed chunk replaces the bad one
        assert _load(store, keys) == 3


def test_objects_sealed_under_a_retired_key_stay_served_while_it_is_listed(medium, tmp_path):
    """Rotation: a node holding the new key first and the old second still
    serves what the old key sealed, and seals with the new one."""
    old, new = auth.new_key(), auth.new_key()
    before, during = str(tmp_path / "before.key"), str(tmp_path / "during.key")
    auth.write_key_file(before, [old])
    auth.write_key_file(during, [new, old])
    keys = keys_for(7, 2)
    with _store(medium, before, Metrics()) as store:
        _save(store, keys[:1])
    metrics = Metrics()
    with _store(medium, during, metrics) as store:
        _save(store, keys[1:])
        assert parse_header(medium.get(store, keys[1])[:4096]).seal_key == auth.key_id(new)
        assert _load(store, keys) == 2
        assert metrics.value("kvtier_auth_failures_total", tier=medium.kind, reason=auth.UNKNOWN_KEY) == 0


@pytest.mark.parametrize("kind", ["shared", "disk"])
def test_verify_with_the_key_reports_and_quarantines_what_engines_refuse(tmp_path, key_file, kind, capsys):
    from kvtier.cli import main

    medium = Files(kind, tmp_path / kind)
    keys = keys_for(8, 4)
    with _store(medium, key_file, Metrics()) as store:
        _save(store, keys)
        genuine = bytearray(medium.get(store, keys[1]))
        genuine[HEADER_BLOCK] ^= 0x01
        medium.put(store, keys[1], rechecksum(genuine))  # tampered
        evil = os.urandom(len(payload_for(keys[2])))
        medium.put(store, keys[2], bytes(encode(keys[2], DTYPE, shape_for(keys[2].num_tokens), evil).buf))  # unsealed
        paths = [store.tier(kind).dir.path(k) for k in keys]
    root = str(medium.root)
    # Without the key only the checksums are checked: the forgeries pass.
    assert main(["store", "verify", "--dir", root, "--no-progress"]) == 0
    assert "seals not checked" in capsys.readouterr().out
    assert main(["store", "verify", "--dir", root, "--no-progress", "--auth-key-file", key_file]) == 1
    out = capsys.readouterr().out
    assert "verified 2 objects; 2 bad" in out
    assert f"{paths[1]}: not served: {auth.BAD_SEAL}" in out and f"{paths[2]}: not served: {auth.UNSEALED}" in out
    assert main(["store", "verify", "--dir", root, "--no-progress", "--auth-key-file", key_file, "--quarantine"]) == 1
    assert [p.exists() for p in paths] == [True, False, False, True]
    assert main(["store", "verify", "--dir", root, "--no-progress", "--auth-key-file", key_file]) == 0
