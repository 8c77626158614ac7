"""The self-describing chunk object: a 4 KiB header block, then the payload.

Layout (all integers little endian; see docs/format.md):

    offset  size  field
    0       8     magic b"KVTCHUNK"
    8       2     format version
    10      2     header struct size (bytes used of the 4 KiB block)
    12      4     flags (0)
    16      32    key digest (names the object)
    48      16    key check (independent chain; detects naming collisions)
    64      32    namespace digest
    96      16    dtype, ASCII, NUL padded
    112     1     ndim (<= 8)
    113     7     reserved, zero
    120     64    shape, 8 x u64 (unused dims zero)
    184     4     token count
    188     8     payload length
    196     16    payload checksum, XXH3-128
    212     8     seal key id (zero: not sealed)
    220     16    seal nonce
    236     16    seal tag (kvtier/auth.py)
    252     4     header checksum, CRC-32 of bytes [0, 252)
    ...           zero padding to 4096
    4096    n     payload, then zero padding to a multiple of 4096

The payload starts 4 KiB aligned and the object length is a multiple of 4 KiB,
so a whole object can be read with one O_DIRECT read into an aligned buffer.
The checksums catch damage; the seal, where a cluster key is configured,
proves who wrote the object (``seal``, ``seal_problem``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Callable

import xxhash

from kvtier.auth import KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES, UNSEALED_ID, Keyring
from kvtier.buffers import ALIGN, BufferPool, align_up, alloc, copy_into
from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.version import FORMAT_VERSION

MAGIC = b"KVTCHUNK"
HEADER_BLOCK = ALIGN
MAX_NDIM = 8
MAX_PAYLOAD = 1 << 32  # 4 GiB: far above any real chunk; refuses absurd headers

_HEAD = struct.Struct("<8sHHI32s16s32s16sB7s8QIQ16s8s16s16s")
_CRC = struct.Struct("<I")
HEADER_STRUCT_SIZE = _HEAD.size + _CRC.size  # 256
CRC_AT = _HEAD.size  # 252: the header checksum, of the bytes before it
TAG_AT = CRC_AT - TAG_BYTES  # 236: the seal's tag; what it authenticates of the header ends here
SEAL_AT = TAG_AT - NONCE_BYTES - KEY_ID_BYTES  # 212: the seal's key id, then its nonce
CHECKSUM_AT = SEAL_AT - 16  # 196: where the payload checksum starts (``expected_head`` ends)
_LAYOUT_AT = 96  # where the dtype starts, after the key and namespace digests
_HEAD_START = struct.pack("<8sHHI", MAGIC, FORMAT_VERSION, HEADER_STRUCT_SIZE, 0)  # magic, version, size, flags
_ZEROS = bytes(HEADER_BLOCK)  # reference for padding checks (either kind is shorter)
_HEADER_PAD = _ZEROS[HEADER_STRUCT_SIZE:]  # what follows the header in its block

DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class Header:
    key: bytes
    check: bytes
    ns: bytes
    dtype: str
    shape: tuple[int, ...]
    num_tokens: int
    payload_len: int
    checksum: bytes
    seal_key: bytes = UNSEALED_ID  # the key id that sealed the object; zeros: not sealed
    nonce: bytes = bytes(NONCE_BYTES)
    tag: bytes = bytes(TAG_BYTES)

    @property
    def object_len(self) -> int:
        return HEADER_BLOCK + align_up(self.payload_len)

    def matches(self, key: ChunkKey) -> bool:
        return (
            self.key == key.digest
            and self.check == key.check
            and self.ns == key.ns
            and self.num_tokens == key.num_tokens
        )


_REFS_LOCK = threading.Lock()


class ChunkObject:
    """An encoded chunk held in an immutable-by-convention buffer.

    ``buf`` covers the whole object (header block + padded payload). Nobody
    writes to it after ``encode``/``decode`` returns, so it may be shared by
    the memory tier, write-through jobs and readers at once.

    Ownership is counted: the creator holds one reference; every further
    owner calls ``retain`` and later ``release``. When the count reaches zero
    a pooled buffer goes back to its pool; an object never released is simply
    garbage collected (safe, just not recycled).
    """

    __slots__ = ("header", "buf", "_refs", "_pool")

    def __init__(self, header: Header, buf: memoryview, pool: BufferPool | None = None):
        self.header = header
        self.buf = buf
        self._refs = 1
        self._pool = pool

    def retain(self) -> "ChunkObject":
        with _REFS_LOCK:
            if self._refs <= 0:
                raise RuntimeError("retain() of a released ChunkObject")
            self._refs += 1
        return self

    def release(self) -> None:
        with _REFS_LOCK:
            self._refs -= 1
            last = self._refs == 0
        if last and self._pool is not None:
            self._pool.put(self.buf)

    @property
    def payload(self) -> memoryview:
        return self.buf[HEADER_BLOCK : HEADER_BLOCK + self.header.payload_len]

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


def key_of(obj: ChunkObject) -> ChunkKey:
    """The key ``obj`` is stored under, as its header names it."""
    h = obj.header
    return ChunkKey(h.key, h.check, h.ns, h.num_tokens)


def payload_checksum(payload: memoryview | bytes) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def encode(
    key: ChunkKey, dtype: str, shape: tuple[int, ...], payload: memoryview | bytes, pool: BufferPool | None = None
) -> ChunkObject:
    """Copy ``payload`` into a new aligned object with its header."""
    src = memoryview(payload).cast("B")
    return build(key, dtype, shape, lambda dst: copy_into(dst, src), pool)


def build(
    key: ChunkKey,
    dtype: str,
    shape: tuple[int, ...],
    fill: Callable[[memoryview], None],
    pool: BufferPool | None = None,
) -> ChunkObject:
    """A new object whose payload ``fill`` writes in place (one copy from the
    source, e.g. an engine's KV blocks, straight into the object buffer)."""
    nbytes = math.prod(shape) * DTYPE_SIZES.get(dtype, 0)
    _check_layout(dtype, tuple(shape), nbytes)
    object_len = HEADER_BLOCK + align_up(nbytes)
    buf = pool.get(object_len) if pool is not None else alloc(object_len)
    try:
        payload = buf[HEADER_BLOCK : HEADER_BLOCK + nbytes]
        fill(payload)
        header = Header(
            key=key.digest,
            check=key.check,
            ns=key.ns,
            dtype=dtype,
            shape=tuple(shape),
            num_tokens=key.num_tokens,
            payload_len=nbytes,
            checksum=payload_checksum(payload),
        )
        buf[:HEADER_BLOCK] = bytes(HEADER_BLOCK)  # a recycled buffer holds old bytes
        buf[:HEADER_STRUCT_SIZE] = pack_header(header)
        if object_len > HEADER_BLOCK + nbytes:
            buf[HEADER_BLOCK + nbytes :] = bytes(object_len - HEADER_BLOCK - nbytes)
    except BaseException:
        if pool is not None:
            pool.put(buf)
        raise
    return ChunkObject(header, buf, pool)


def pack_header(h: Header) -> bytes:
    shape = list(h.shape) + [0] * (MAX_NDIM - len(h.shape))
    head = _HEAD.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_STRUCT_SIZE,
        0,
        h.key,
        h.check,
        h.ns,
        h.dtype.encode("ascii"),
        len(h.shape),
        b"",
        *shape,
        h.num_tokens,
        h.payload_len,
        h.checksum,
        h.seal_key,
        h.nonce,
        h.tag,
    )
    return head + _CRC.pack(zlib.crc32(head))


def expected_head(key: ChunkKey, dtype: str, shape: tuple[int, ...], payload_len: int) -> bytes | None:
    """The header bytes before the payload checksum (``CHECKSUM_AT``) of
    ``key``'s object, if its payload has this layout: what ``pack_header``
    writes there (None for a key whose digests are not of the format's
    lengths: no object can echo it). The native read loop compares an
    object's header with them (and checks its CRC-32) instead of handing it
    to ``parse_header``; the layout must come from a header that was parsed
    (``layout``)."""
    head = b"".join((_HEAD_START, key.digest, key.check, key.ns, _layout_bytes(dtype, shape, key.num_tokens, payload_len)))
    return head if len(head) == CHECKSUM_AT and len(key.digest) == 32 and len(key.check) == 16 else None


@functools.lru_cache(maxsize=1024)
def _layout_bytes(dtype: str, shape: tuple[int, ...], num_tokens: int, payload_len: int) -> bytes:
    """``expected_head``'s bytes after the namespace: the same for every
    chunk of a layout and token count."""
    whole = pack_header(Header(bytes(32), bytes(16), bytes(32), dtype, shape, num_tokens, payload_len, bytes(16)))
    return whole[_LAYOUT_AT:CHECKSUM_AT]


def layout(header: Header) -> tuple[str, tuple[int, ...], int]:
    """What ``expected_head`` needs of a parsed header besides the key."""
    return header.dtype, header.shape, header.payload_len


def expected_header(key: ChunkKey, layout: tuple[str, tuple[int, ...], int], tail: bytes) -> Header:
    """The header of an object whose bytes before the payload checksum were
    found equal to ``expected_head(key, *layout)`` and whose header CRC-32
    matched: the one ``parse_header`` would return. ``tail`` is the
    header's bytes [CHECKSUM_AT, CRC_AT): payload checksum and seal."""
    dtype, shape, payload_len = layout
    checksum, kid, nonce, tag = _TAIL.unpack(tail)
    return Header(key.digest, key.check, key.ns, dtype, shape, key.num_tokens, payload_len, checksum, kid, nonce, tag)


_TAIL = struct.Struct(f"<16s{KEY_ID_BYTES}s{NONCE_BYTES}s{TAG_BYTES}s")


def parse_header(block: memoryview | bytes) -> Header:
    """Parse and validate a header block. Raises CorruptObject on any doubt."""
    block = memoryview(block)
    if block.nbytes < HEADER_STRUCT_SIZE:
        raise CorruptObject(f"object shorter than a header ({block.nbytes} B)")
    head = block[: _HEAD.size]
    (crc,) = _CRC.unpack(block[_HEAD.size : HEADER_STRUCT_SIZE])
    if zlib.crc32(head) != crc:
        raise CorruptObject("header checksum mismatch")
    (magic, version, hsize, flags, key, check, ns, dtype, ndim, reserved, *rest) = _HEAD.unpack(head)
    shape8, (num_tokens, payload_len, checksum, kid, nonce, tag) = rest[:MAX_NDIM], rest[MAX_NDIM:]
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptObject(f"format version {version}, this reader speaks {FORMAT_VERSION}")
    if hsize != HEADER_STRUCT_SIZE or flags != 0 or any(reserved):
        raise CorruptObject("unknown header size, flags or reserved bytes")
    if not 0 < ndim <= MAX_NDIM or any(shape8[ndim:]):
        raise CorruptObject(f"bad ndim {ndim}")
    try:
        dtype_s = dtype.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptObject("dtype is not ASCII") from exc
    shape = tuple(shape8[:ndim])
    try:
        _check_layout(dtype_s, shape, payload_len)
    except ValueError as exc:
        raise CorruptObject(str(exc)) from exc
    return Header(key, check, ns, dtype_s, shape, num_tokens, payload_len, checksum, kid, nonce, tag)


def _check_layout(dtype: str, shape: tuple[int, ...], payload_len: int) -> None:
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not 0 < len(shape) <= MAX_NDIM or any(d <= 0 for d in shape):
        raise ValueError(f"bad shape {shape}")
    if not 0 < payload_len <= MAX_PAYLOAD:
        raise ValueError(f"payload length {payload_len} out of range")
    if math.prod(shape) * DTYPE_SIZES[dtype] != payload_len:
        raise ValueError(f"shape {shape} of {dtype} does not match payload length {payload_len}")


def decode(buf: memoryview, key: ChunkKey, expect_len: int | None = None, pool: BufferPool | None = None,
           payload_checked: bool = False) -> ChunkObject:
    """Verify a whole object read from storage against the key it was read for.

    ``expect_len`` is the number of bytes actually read (a truncated file reads
    short). Raises CorruptObject on any mismatch; never returns doubtful data.
    ``payload_checked``: the native read loop (kvtier/_native/readloop.c)
    already checked, in this buffer, which nobody wrote since, what no
    header field describes: that the padding (after the header struct, and
    after the payload of the length this header gives) is zero, and that
    the payload's XXH3-128 is the checksum this header holds. The header
    itself (its checksum, every field, the key) is checked here as always.
    """
    header = parse_header(buf[:HEADER_STRUCT_SIZE])
    have = buf.nbytes if expect_len is None else min(expect_len, buf.nbytes)
    # Writers always write the whole block-aligned object: anything shorter is
    # torn or truncated, even where the cut only loses padding.
    if have < header.object_len:
        raise CorruptObject(f"truncated: {have} B, need {header.object_len}")
    # Padding is zero by format; a nonzero byte there is damage the checksums
    # do not cover, and damaged storage is not to be trusted.
    end = HEADER_BLOCK + header.payload_len
    # Compared as bytes (a memcmp): a memoryview compares item by item, at a
    # cost that rivals the payload's checksum.
    if not payload_checked and (
        bytes(buf[HEADER_STRUCT_SIZE:HEADER_BLOCK]) != _HEADER_PAD
        or bytes(buf[end : header.object_len]) != _ZEROS[: header.object_len - end]
    ):
        raise CorruptObject("nonzero bytes in the padding")
    if not header.matches(key):
        raise CorruptObject("key, check, namespace or token count does not match the requested key")
    obj = ChunkObject(header, buf, pool)
    if not payload_checked and payload_checksum(obj.payload) != header.checksum:
        raise CorruptObject("payload checksum mismatch")
    return obj


# ------------------------------------------------------------ the seal
def seal(obj: ChunkObject, ring: Keyring) -> None:
    """Seal a new object with the ring's sealing key (kvtier/auth.py): a
    fresh nonce, the tag over the header up to it and the payload, and the
    header CRC again, in place. Only for an object nobody else holds yet
    (just built); an object sealed already is left as it is."""
    h = obj.header
    if h.seal_key != UNSEALED_ID:
        return
    h = dataclasses.replace(h, seal_key=ring.write_id, nonce=ring.nonce())
    tag = ring.tag(ring.write_id, pack_header(h)[:TAG_AT], obj.payload)
    assert tag is not None  # the ring holds its own sealing key
    h = dataclasses.replace(h, tag=tag)
    obj.buf[:HEADER_STRUCT_SIZE] = pack_header(h)
    obj.header = h


def seal_problem(obj: ChunkObject, ring: Keyring) -> str | None:
    """None where ``obj``'s seal checks out under a key of ``ring``, else
    why not (``auth.UNSEALED``, ``UNKNOWN_KEY``, ``BAD_SEAL``). What is
    authenticated is the header as parsed (re-packed: the fields a reader
    acts on, not the bytes it happened to read) and the payload."""
    h = obj.header
    return ring.check(h.seal_key, pack_header(h)[:TAG_AT], obj.payload, h.tag)
