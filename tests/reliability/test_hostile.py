"""Case 15: hostile input.

- Odd bytes and traversal attempts in configured names, keys and namespace
  fields never reach a path: names are hex digests under the store.
- Symlinks planted in a shared directory (for an object, a fan-out folder,
  the objects, temp or quarantine folder), pointing outside the store: kvtier
  never reads through them, and never writes, moves or deletes anything
  outside the store.
- A FIFO planted as an object does not block a reader.
- Oversized or absurd header fields are refused with a clear error, before
  any large allocation.
- Files are created 0600 and folders 0700 whatever the umask.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

from kvtier.buffers import BufferPool
from kvtier.codec import HEADER_BLOCK, HEADER_STRUCT_SIZE, parse_header
from kvtier.errors import ConfigError, CorruptObject
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.metrics import Metrics
from kvtier.tiers.dir import beneath
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.dir.files import ObjectDir
from kvtier.tiers.shared import SharedTier
from tests.support import NS, OBJ, disk_config, make_chunks, obj_for, objs_for, payload_for, shared_config, tokens_for


# ---------------------------------------------------------------- the world outside the store


class Outside:
    """A folder next to the store with files kvtier must never touch."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        (root / "canary.txt").write_bytes(b"not kvtier's")

    def snapshot(self) -> dict[str, tuple[bytes, int]]:
        out = {}
        for p in sorted(self.root.rglob("*")):
            st = os.lstat(p)
            out[str(p.relative_to(self.root))] = (p.read_bytes() if p.is_file() and not p.is_symlink() else b"", st.st_mtime_ns)
        return out


@pytest.fixture
def outside(tmp_path) -> Outside:
    return Outside(tmp_path / "outside")


def _shared(tmp_path, metrics=None, **kw) -> SharedTier:
    kw.setdefault("tmp_max_age_s", 0.0)  # sweeps take everything they would take
    return SharedTier(shared_config(tmp_path / "store", 8 * OBJ, **kw), metrics or Metrics())


def _fetch_all(tier, keys) -> list[bytes]:
    out = []
    for obj in tier.fetch(keys):
        out.append(bytes(obj.payload))
        obj.release()
    return out


# ---------------------------------------------------------------- names, keys, namespaces

ODD = ["../../../etc/passwd", "..", "/abs/path", "a\x00b", "line\nbreak", "\udc80\udfff", "é" * 3, "%2e%2e%2f", " " * 3,
       "x" * 100_000]


@pytest.mark.parametrize("i", range(len(ODD)))
def test_odd_namespace_fields_and_names_stay_inside_the_store(tmp_path, outside, i):
    odd = ODD[i]
    ns = Namespace(model=odd, model_fingerprint=odd, kv_dtype="float16", layout=odd, num_layers=2, num_kv_heads=2,
                   head_dim=8, chunk_tokens=16, tenant_salt=odd)
    keys = chunk_keys(ns, tokens_for(1, 3 * 16))
    before = outside.snapshot()
    tier = SharedTier(shared_config(tmp_path / "store", 8 * OBJ, name=odd[:200]), Metrics())
    try:
        assert tier.store(objs_for(keys)) == 3
        assert _fetch_all(tier, keys) == [payload_for(k) for k in keys]
        for path in (tmp_path / "store").rglob("*"):
            rel = path.relative_to(tmp_path / "store")
            assert all(part.isascii() and part.replace(".", "").replace("_", "").replace("-", "").isalnum()
                       for part in rel.parts), rel
    finally:
        tier.close()
    assert sorted(os.listdir(tmp_path)) == ["outside", "store"]
    assert outside.snapshot() == before


def test_any_digest_names_a_file_inside_the_objects_folder(tmp_path):
    d = ObjectDir(tmp_path / "store", "path")
    for raw in (b"../" * 11 or b"", b"/" * 32, b"\0" * 32, bytes(range(32)), b"\xff" * 32):
        raw = (raw * 2)[:32]
        key = ChunkKey(raw, b"\0" * 16, (raw * 2)[:32], 16)
        path = d.path(key)
        assert path.resolve().is_relative_to(d.objects.resolve())
        assert path.name == raw.hex() + ".kvc"


# ---------------------------------------------------------------- planted symlinks


@pytest.fixture(params=["openat2", "folder by folder"])
def resolution(request, monkeypatch):
    """Reads resolve an object's path in one ``openat2`` where the kernel
    has it, else folder by folder: planted links are refused both ways."""
    if request.param == "openat2":
        assert beneath.available(), "this kernel has no openat2 (Linux 5.6+): the fallback alone is tested"
    else:
        monkeypatch.setattr(beneath, "_available", False)
    return request.param


def _valid_copy_outside(tier, key, outside: Outside, name: str) -> Path:
    """A genuine object for ``key`` placed outside the store: if kvtier read
    through a link to it, it would even verify."""
    p = outside.root / name
    p.write_bytes(bytes(obj_for(key).buf))
    return p


def test_an_object_that_is_a_symlink_is_neither_read_nor_followed(tmp_path, outside, resolution):
    metrics = Metrics()
    tier = _shared(tmp_path, metrics)
    c = make_chunks(2)
    tier.store(c.objs[:1])
    target = _valid_copy_outside(tier, c.keys[1], outside, "foreign.kvc")
    link = tier.dir.path(c.keys[1])
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    before = outside.snapshot()
    assert tier.lookup(c.keys) == 1
    assert _fetch_all(tier, [c.keys[1]]) == []
    assert tier.store(c.objs) == 2  # replaces the link itself with a real object
    assert not link.is_symlink() and _fetch_all(tier, c.keys) == c.payloads
    assert tier.delete(c.keys) == 2
    assert tier.gc().ran
    tier.close()
    assert outside.snapshot() == before


@pytest.mark.parametrize("where", ["fanout", "namespace", "objects"])
def test_a_symlinked_folder_is_never_read_written_or_emptied_through(tmp_path, outside, where, resolution):
    metrics = Metrics()
    tier = _shared(tmp_path, metrics, high_watermark=0.5, low_watermark=0.25)
    c = make_chunks(3)
    key = c.keys[0]
    real = tier.dir.path(key).parent  # objects/<ns>/<fan>
    folder = {"fanout": real, "namespace": real.parent, "objects": real.parent.parent}[where]
    # Outside, a tree that looks exactly like kvtier's below ``folder``, with
    # a genuine object for ``key`` in it.
    mirror = outside.root / "mirror"
    inner = mirror / real.relative_to(folder) if folder != real else mirror
    inner.mkdir(parents=True)
    _valid_copy_outside(tier, key, outside, str((inner / tier.dir.path(key).name).relative_to(outside.root)))
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(mirror, folder)
    before = outside.snapshot()

    assert _fetch_all(tier, [key]) == []  # not read through the link
    buf = bytearray(len(payload_for(key)))
    assert tier.load([key], [buf]) == 0
    tier.store(c.objs)  # must not land outside
    tier.delete(c.keys)  # must not delete outside
    tier.gc()  # must not collect outside
    tier.dir.quarantine(key)  # must not move the outside object in
    tier.close()
    assert outside.snapshot() == before


@pytest.mark.parametrize("folder", ["tmp", "quarantine"])
def test_sweeps_never_delete_through_a_symlinked_folder(tmp_path, outside, folder):
    tier = _shared(tmp_path)
    tier.close()
    d = tier.dir
    path = {"tmp": d.tmp, "quarantine": d.quarantine_dir}[folder]
    old = time.time() - 10 * 86400
    for name in ("otherhost.1.aa.tmp", "0" * 64 + ".1.kvc", "precious.db"):
        p = outside.root / name
        p.write_bytes(b"x")
        os.utime(p, (old, old))
    before = outside.snapshot()
    shutil.rmtree(path)
    os.symlink(outside.root, path)
    try:
        again = _shared(tmp_path)  # start: sweeps temp files
    except ConfigError as exc:  # refusing to start on a tampered store, naming the link, is fine too
        assert f"{path} is a symbolic link" in str(exc) and f"rm {path}" in str(exc), exc
    else:
        again.store(make_chunks(1).objs)
        again.gc()  # sweeps temp and quarantine
        d.sweep_tmp(0.0)
        again.close()
    assert outside.snapshot() == before


# ---------------------------------------------------------------- FIFOs and huge files


def test_a_fifo_planted_as_an_object_does_not_block_a_reader(tmp_path, resolution):
    metrics = Metrics()
    tier = _shared(tmp_path, metrics)
    c = make_chunks(1)
    path = tier.dir.path(c.keys[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path, 0o600)
    result = []
    t = threading.Thread(target=lambda: result.append(_fetch_all(tier, c.keys)), daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # release the reader before failing
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
        pytest.fail("a read blocked on a FIFO planted in the store")
    assert result == [[]]
    tier.close()


def _header(**fields) -> bytes:
    """A header block with chosen raw fields and a valid CRC."""
    obj = make_chunks(1).objs[0]
    head = bytearray(bytes(obj.buf[:HEADER_STRUCT_SIZE - 4]))
    offsets = {"version": (8, "<H"), "ndim": (112, "<B"), "shape0": (120, "<Q"), "tokens": (184, "<I"),
               "payload_len": (188, "<Q"), "dtype": (96, "16s"), "shape": (120, "<8Q")}
    for name, value in fields.items():
        off, fmt = offsets[name]
        struct.pack_into(fmt, head, off, *(value if isinstance(value, tuple) else (value,)))
    return bytes(head) + struct.pack("<I", zlib.crc32(head))


@pytest.mark.parametrize("fields,words", [
    ({"payload_len": 1 << 40}, "payload length"),
    ({"payload_len": (1 << 64) - 1}, "payload length"),
    ({"ndim": 9}, "ndim"),
    ({"ndim": 255}, "ndim"),
    ({"shape0": (1 << 63)}, "shape"),
    ({"dtype": b"\xff" * 16}, "dtype"),
    ({"dtype": b"float1024"}, "dtype"),
    ({"version": 0xFFFF}, "version"),
])
def test_oversized_header_fields_are_refused_with_a_clear_error(fields, words):
    with pytest.raises(CorruptObject, match=words):
        parse_header(_header(**fields))


@pytest.mark.parametrize("whose", ["own key", "foreign key"])
def test_a_huge_sparse_object_is_refused_without_allocating_it(tmp_path, monkeypatch, whose):
    """A 3 GiB sparse file whose header claims a 3 GiB payload, echoing the
    key asked for (it then cannot be that long) or another key."""
    metrics = Metrics()
    tier = _shared(tmp_path, metrics)
    c = make_chunks(2)
    if whose == "foreign key":
        c.keys.reverse()
    path = tier.dir.path(c.keys[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a 3 GiB sparse file whose header claims 3 GiB
        f.write(_header(payload_len=3 << 30, shape=(3 << 30, 0, 0, 0, 0, 0, 0, 0), dtype=b"uint8", ndim=1))
        f.truncate(3 << 30)
    asked = []
    real_get = BufferPool.get
    monkeypatch.setattr(BufferPool, "get", lambda self, n: asked.append(n) or real_get(self, n))
    t0 = time.monotonic()
    assert _fetch_all(tier, c.keys) == []
    assert time.monotonic() - t0 < 5
    assert max(asked, default=0) <= 1 << 20, f"allocated {max(asked)} B for a doubtful object"
    assert metrics.value("kvtier_integrity_failures_total", tier=tier.name) == 1
    tier.close()


# ---------------------------------------------------------------- permissions


def test_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        disk = DiskTier(disk_config(tmp_path / "disk", 2 * OBJ), Metrics())
        shared = _shared(tmp_path)
        c = make_chunks(3)
        for tier in (disk, shared):
            tier.store(c.objs)  # the disk tier evicts the first
            bad = tier.dir.path(c.keys[2])
            with open(bad, "r+b") as f:
                f.seek(HEADER_BLOCK)
                f.write(b"\xff")
            _fetch_all(tier, c.keys[2:])  # quarantined
        shared.gc()
        disk.close()
        shared.close()
        disk = DiskTier(disk_config(tmp_path / "disk", 2 * OBJ), Metrics())  # rewrites its access log
        disk.close()
    finally:
        os.umask(old)
    for root in (tmp_path / "disk" / "kvtier-v1", tmp_path / "store" / "kvtier-v1"):
        assert root.exists()
        for p in [root, *root.rglob("*")]:
            mode = stat.S_IMODE(os.lstat(p).st_mode)
            want = 0o700 if p.is_dir() else 0o600
            assert mode == want, f"{p} is {oct(mode)}, want {oct(want)}"


@pytest.mark.parametrize("o_direct", [True, False])
def test_a_large_genuine_object_is_read_whole(tmp_path, o_direct):
    """Objects above the size whose header is checked first (16 MiB: chunks
    of larger models) still read whole, with garbage after them ignored."""
    from kvtier.codec import encode

    key = make_chunks(1).keys[0]
    payload = hashlib.sha256(b"big").digest() * ((20 << 20) // 32)  # 20 MiB
    tier = _shared(tmp_path, o_direct=o_direct)
    try:
        assert tier.store([encode(key, "uint8", (len(payload),), payload)]) == 1
        with open(tier.dir.path(key), "ab") as f:
            f.write(b"\xee" * 8192)  # trailing garbage is not part of the object
        got = []
        for obj in tier.fetch([key]):
            got.append(bytes(obj.payload) == payload)
            obj.release()
        assert got == [True]
    finally:
        tier.close()


def test_openat2_refuses_links_files_for_folders_and_escapes_on_any_component(tmp_path, outside):
    """``open_beneath``: what ``ObjectDir`` relies on when it opens an
    object's whole path in one call."""
    assert beneath.available()
    base = tmp_path / "base"
    (base / "a" / "b").mkdir(parents=True)
    (base / "a" / "b" / "f").write_bytes(b"ours")
    (base / "a" / "file").write_bytes(b"")
    os.symlink(outside.root, base / "a" / "link")
    os.symlink(base / "a" / "b" / "f", base / "a" / "b" / "flink")
    (outside.root / "b").mkdir()
    (outside.root / "b" / "f").write_bytes(b"not ours")
    bfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = beneath.open_beneath(bfd, "a/b/f", os.O_RDONLY)
        assert os.read(fd, 10) == b"ours"
        os.close(fd)
        for path, err in (("a/link/b/f", errno.ELOOP), ("a/b/flink", errno.ELOOP), ("a/file/f", errno.ENOTDIR),
                          ("../base/a/b/f", errno.EXDEV), (str(base / "a" / "b" / "f"), errno.EXDEV)):
            with pytest.raises(OSError) as exc:
                beneath.open_beneath(bfd, path, os.O_RDONLY)
            assert exc.value.errno == err, path
        with pytest.raises(FileNotFoundError):
            beneath.open_beneath(bfd, "a/b/missing", os.O_RDONLY)
    finally:
        os.close(bfd)


def test_a_read_opens_the_objects_path_in_one_call_where_the_kernel_can(tmp_path, monkeypatch):
    """No folder is opened one by one on a read (each is a round trip to a
    network file system's metadata server), unless openat2 is missing."""
    tier = _shared(tmp_path)
    c = make_chunks(2)
    tier.store(c.objs)
    walked = []
    real = ObjectDir._open_below
    monkeypatch.setattr(ObjectDir, "_open_below",
                        staticmethod(lambda fd, parts, create=False, own=False: (walked.append(parts),
                                                                                 real(fd, parts, create, own))[1]))
    assert _fetch_all(tier, c.keys) == c.payloads
    assert walked == []
    monkeypatch.setattr(beneath, "_available", False)
    assert _fetch_all(tier, c.keys) == c.payloads
    assert [p[0] for p in walked] == ["objects", "objects"]
    tier.close()


@pytest.mark.parametrize("abandoned", [False, True])
@pytest.mark.parametrize("how", ["aio", "pool threads, O_DIRECT", "pool threads, buffered"])
def test_a_load_opens_the_stores_folder_once_not_once_per_object(tmp_path, monkeypatch, resolution, how, abandoned):
    """A load's object opens start from the store's folder, opened once for
    the load and closed after it, whichever way it reads, also when the
    consumer gives up after the first object (not held by the tier: that
    would keep an unmounted file system busy)."""
    tier = _shared(tmp_path, aio=how == "aio", o_direct=how != "pool threads, buffered", read_window_bytes=2 * OBJ)
    c = make_chunks(6)
    tier.store(c.objs)
    base = str(tier.dir.base)
    opened, closed, held = [], [], set()
    real_open, real_close = os.open, os.close

    def counting_open(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        if str(path) == base and k.get("dir_fd") is None:
            opened.append(fd)
            held.add(fd)
        return fd

    def counting_close(fd):
        if fd in held:
            held.discard(fd)
            closed.append(fd)
        return real_close(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "close", counting_close)
    if abandoned:
        it = tier.fetch(c.keys)
        first = next(it)
        assert bytes(first.payload) == c.payloads[0]
        first.release()
        it.close()
    else:
        bufs = [bytearray(len(p)) for p in c.payloads]
        assert tier.load(c.keys, bufs) == 6
        assert [bytes(b) for b in bufs] == c.payloads
    tier.close()
    assert len(opened) == 1
    assert not held  # closed once the load ended
    assert closed == opened
