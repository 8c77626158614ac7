"""Helpers shared by the test modules (fixtures live in conftest.py).

Every chunk in these tests has the same geometry (``NS``): 16 tokens of
128 B of KV each, so a full chunk is a 2 KiB payload and every object, full
or partial, is exactly ``OBJ`` = 8 KiB (one header block, one payload block).
Capacities are written in units of ``OBJ``.

Payloads are a pure function of the key (``payload_for``), so any process can
tell whether an object it reads is the one that was written for its key.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from kvtier.codec import CHECKSUM_AT, CRC_AT, HEADER_BLOCK, ChunkObject, encode, payload_checksum
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.tiers.disk import DiskConfig
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.memory import MemoryConfig
from kvtier.tiers.shared import SharedConfig

NS = Namespace(
    model="test/model",
    model_fingerprint="sha256:00",
    kv_dtype="float16",
    layout="test:LKHTD",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    chunk_tokens=16,
)
DTYPE = "float16"
BYTES_PER_TOKEN = NS.num_layers * 2 * NS.num_kv_heads * NS.head_dim * 2  # K and V, 2 B each
OBJ = 8192  # every object of NS: 4 KiB header block + one 4 KiB payload block


def shape_for(num_tokens: int) -> tuple[int, ...]:
    return (NS.num_layers, 2, NS.num_kv_heads, num_tokens, NS.head_dim)


def payload_for(key: ChunkKey, nbytes: int | None = None) -> bytes:
    """The deterministic payload of ``key`` (BYTES_PER_TOKEN per token)."""
    n = key.num_tokens * BYTES_PER_TOKEN if nbytes is None else nbytes
    seed = hashlib.sha256(b"payload" + key.digest).digest()
    return (seed * (n // len(seed) + 1))[:n]


def tokens_for(seed: int, n_tokens: int) -> list[int]:
    """Deterministic token ids, different for every seed."""
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(n_tokens)]


def keys_for(seed: int, n_chunks: int, ns: Namespace = NS) -> list[ChunkKey]:
    return chunk_keys(ns, tokens_for(seed, n_chunks * ns.chunk_tokens))


def obj_for(key: ChunkKey) -> ChunkObject:
    return encode(key, DTYPE, shape_for(key.num_tokens), payload_for(key))


def objs_for(keys: Sequence[ChunkKey]) -> list[ChunkObject]:
    return [obj_for(k) for k in keys]


@dataclass
class Chunks:
    keys: list[ChunkKey]
    objs: list[ChunkObject]

    @property
    def payloads(self) -> list[bytes]:
        return [payload_for(k) for k in self.keys]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [shape_for(k.num_tokens) for k in self.keys]


def make_chunks(n: int, seed: int = 1) -> Chunks:
    keys = keys_for(seed, n)
    return Chunks(keys, objs_for(keys))


# ---------------------------------------------------------------- configs


def memory_config(capacity: int = 64 * OBJ, **kw) -> MemoryConfig:
    return MemoryConfig(capacity=capacity, **kw)


def disk_config(path: Path, capacity: int = 64 * OBJ, **kw) -> DiskConfig:
    kw.setdefault("io_threads", 4)
    return DiskConfig(path=str(path), capacity=capacity, **kw)


def shared_config(path: Path, capacity: int = 64 * OBJ, **kw) -> SharedConfig:
    """A shared tier at ``path``, which is made here if missing: a shared
    tier's folder must exist (a mount point), kvtier never makes it."""
    Path(path).mkdir(parents=True, exist_ok=True)
    kw.setdefault("io_threads", 4)
    kw.setdefault("gc_interval_s", 0.0)  # tests run collection passes themselves
    return SharedConfig(path=str(path), capacity=capacity, **kw)


def hold_reads(tier, keys: Sequence[ChunkKey], first_held: int, gate: threading.Event) -> None:
    """Make a directory tier's reads of ``keys[first_held:]`` wait for
    ``gate`` before they finish, on whichever read path it uses: a pool
    thread per read (``_read_one``) or native AIO (the default; each landed
    object is finished by ``_finish_read``, or by ``_finish_exact`` where
    the native read loop found its header exactly as expected)."""
    read, finish, exact = tier._read_one, tier._finish_read, tier._finish_exact

    def held(key):
        if keys.index(key) >= first_held:
            assert gate.wait(10)

    def read_one(key, **kw):
        held(key)
        return read(key, **kw)

    def finish_read(key, *args, **kw):
        held(key)
        return finish(key, *args, **kw)

    def finish_exact(key, *args, **kw):
        held(key)
        return exact(key, *args, **kw)

    tier._read_one, tier._finish_read, tier._finish_exact = read_one, finish_read, finish_exact


def flip_byte(path, offset: int, mask: int = 0xFF) -> None:
    """Damage one byte of the file at ``path`` in place (XOR ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def assert_object(obj: ChunkObject, key: ChunkKey) -> None:
    """``obj`` is the object written for ``key``."""
    assert obj.header.matches(key)
    assert bytes(obj.payload) == payload_for(key)


def tmp_files(dir_: ObjectDir) -> list[str]:
    return sorted(os.listdir(dir_.tmp))


# ---------------------------------------------------------------- fault injection


class WriteGate:
    """Holds every ``ObjectDir.write`` until ``open()`` (the real write then
    runs). Used to keep write-through busy without mocking storage."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self._event = threading.Event()
        self.waiting = threading.Semaphore(0)
        real = ObjectDir.write

        def gated(dir_self, obj, key, fsync):
            self.waiting.release()
            if not self._event.wait(30):
                raise TimeoutError("write gate never opened")
            return real(dir_self, obj, key, fsync)

        monkeypatch.setattr(ObjectDir, "write", gated)

    def open(self) -> None:
        self._event.set()


def spin_cpu(seconds: float) -> None:
    """Spend ``seconds`` of the calling thread's CPU (its own clock)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


# ---------------------------------------------------------------- what an attacker writes
def rechecksum(data: bytearray) -> bytes:
    """What an attacker does after changing an object's bytes: fix the
    payload checksum and the header CRC, computed as docs/format.md says,
    so that only the seal can tell."""
    n = struct.unpack_from("<Q", data, 188)[0]
    data[CHECKSUM_AT : CHECKSUM_AT + 16] = payload_checksum(bytes(data[HEADER_BLOCK : HEADER_BLOCK + n]))
    struct.pack_into("<I", data, CRC_AT, zlib.crc32(bytes(data[:CRC_AT])))
    return bytes(data)


def forgery(key: ChunkKey) -> bytes:
    """A well-formed, unsealed object for ``key`` whose payload is the
    attacker's own (random), checksums right."""
    return bytes(encode(key, DTYPE, shape_for(key.num_tokens), os.urandom(len(payload_for(key)))).buf)


def plant_attacks(get, put, names: Sequence, keys: Sequence[ChunkKey]) -> list:
    """On a tier holding ``keys``'s genuine objects under ``names`` (raw
    ``get(name)``/``put(name, bytes)``): keys[1] tampered, keys[2] an
    unsealed forgery, keys[3] a replay of keys[4]'s object. Returns the
    three names."""
    tampered = bytearray(get(names[1]))
    tampered[HEADER_BLOCK + 10] ^= 0x01
    put(names[1], rechecksum(tampered))
    put(names[2], forgery(keys[2]))
    put(names[3], get(names[4]))
    return list(names[1:4])
