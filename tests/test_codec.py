"""The chunk object: layout as documented, round trip, and a reader that
never returns doubtful data, whatever the bytes."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvtier.buffers import alloc
from kvtier.codec import (
    CHECKSUM_AT,
    CRC_AT,
    HEADER_BLOCK,
    HEADER_STRUCT_SIZE,
    MAGIC,
    decode,
    encode,
    expected_head,
    expected_header,
    layout,
    parse_header,
    payload_checksum,
)
from kvtier.errors import CorruptObject
from kvtier.version import FORMAT_VERSION
from tests.support import DTYPE, keys_for, obj_for, payload_for, shape_for

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KEY = keys_for(seed=3, n_chunks=1)[0]
OBJ = obj_for(KEY)
VALID = bytes(OBJ.buf)
# A second, multi-block object: a payload that does not end on a block edge.
BIG_SHAPE = (3, 1000)  # 3000 float16 = 6000 B: two payload blocks, last one padded
BIG_PAYLOAD = (bytes(range(1, 256)) * 24)[:6000]
BIG = encode(KEY, DTYPE, BIG_SHAPE, BIG_PAYLOAD)
BIG_VALID = bytes(BIG.buf)


def _decode(data: bytes, key=KEY):
    buf = alloc(len(data))
    buf[:] = data
    return decode(buf, key)


# ---------------------------------------------------------------- round trip and layout


def test_round_trip():
    obj = _decode(VALID)
    assert bytes(obj.payload) == payload_for(KEY)
    h = obj.header
    assert (h.key, h.check, h.ns, h.num_tokens) == (KEY.digest, KEY.check, KEY.ns, KEY.num_tokens)
    assert (h.dtype, h.shape, h.payload_len) == (DTYPE, shape_for(KEY.num_tokens), len(payload_for(KEY)))
    assert h.checksum == payload_checksum(payload_for(KEY))


@pytest.mark.parametrize("data", [VALID, BIG_VALID], ids=["chunk", "odd-sized"])
def test_the_expected_head_is_what_the_writer_wrote(data):
    """What the native read loop compares a header with: the header's bytes
    up to the payload checksum, from the key and a layout parsed before;
    and the header it then stands for is the parsed one."""
    h = parse_header(data[:HEADER_STRUCT_SIZE])
    assert expected_head(KEY, *layout(h)) == data[:CHECKSUM_AT]
    assert expected_header(KEY, layout(h), data[CHECKSUM_AT:CRC_AT]) == h
    other = keys_for(seed=4, n_chunks=1)[0]
    assert expected_head(other, *layout(h)) != data[:CHECKSUM_AT]
    # A key no object can echo (a digest of another length) expects nothing.
    assert expected_head(KEY._replace(digest=KEY.digest[:31]), *layout(h)) is None


def test_round_trip_of_a_payload_that_is_not_block_sized():
    obj = _decode(BIG_VALID)
    assert bytes(obj.payload) == BIG_PAYLOAD
    assert obj.header.shape == BIG_SHAPE


def test_encode_copies_the_payload():
    src = bytearray(payload_for(KEY))
    obj = encode(KEY, DTYPE, shape_for(KEY.num_tokens), src)
    src[:] = bytes(len(src))
    assert bytes(obj.payload) == payload_for(KEY)


@pytest.mark.parametrize("obj,payload", [(OBJ, payload_for(KEY)), (BIG, BIG_PAYLOAD)])
def test_layout_matches_the_format_document(obj, payload):
    buf = bytes(obj.buf)
    n = len(payload)
    assert HEADER_BLOCK == 4096 and HEADER_STRUCT_SIZE == 256
    assert len(buf) % 4096 == 0
    assert len(buf) == 4096 + (n + 4095) // 4096 * 4096
    assert buf[4096 : 4096 + n] == payload  # payload starts 4 KiB aligned
    assert buf[4096 + n :] == bytes(len(buf) - 4096 - n)  # zero padding to a block
    assert buf[HEADER_STRUCT_SIZE:4096] == bytes(4096 - HEADER_STRUCT_SIZE)
    h = obj.header
    assert buf[0:8] == MAGIC
    assert struct.unpack_from("<H", buf, 8)[0] == FORMAT_VERSION
    assert struct.unpack_from("<H", buf, 10)[0] == HEADER_STRUCT_SIZE
    assert struct.unpack_from("<I", buf, 12)[0] == 0
    assert buf[16:48] == h.key
    assert buf[48:64] == h.check
    assert buf[64:96] == h.ns
    assert buf[96:112].rstrip(b"\0") == h.dtype.encode()
    assert buf[112] == len(h.shape)
    assert buf[113:120] == bytes(7)
    shape8 = struct.unpack_from("<8Q", buf, 120)
    assert shape8 == tuple(h.shape) + (0,) * (8 - len(h.shape))
    assert struct.unpack_from("<I", buf, 184)[0] == h.num_tokens
    assert struct.unpack_from("<Q", buf, 188)[0] == n
    assert buf[196:212] == payload_checksum(payload)
    assert buf[212:252] == bytes(40)  # not sealed: key id, nonce and tag are zero
    assert struct.unpack_from("<I", buf, 252)[0] == zlib.crc32(buf[:252])


def test_buffer_is_page_aligned():
    from kvtier.buffers import address

    assert address(OBJ.buf) % 4096 == 0


@pytest.mark.parametrize(
    "dtype,shape,nbytes",
    [("float16", (2, 3), 10), ("float64", (2,), 16), ("float16", (), 0), ("float16", (0, 4), 0),
     ("float16", (1,) * 9, 2)],
)
def test_encode_refuses_inconsistent_layouts(dtype, shape, nbytes):
    with pytest.raises(ValueError):
        encode(KEY, dtype, shape, bytes(nbytes))


# ---------------------------------------------------------------- identity


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(keys_for(seed=4, n_chunks=1)[0], id="other-key"),
        pytest.param(KEY._replace(digest=bytes(32)), id="digest"),
        pytest.param(KEY._replace(check=bytes(16)), id="check"),
        pytest.param(KEY._replace(ns=bytes(32)), id="namespace"),
        pytest.param(KEY._replace(num_tokens=KEY.num_tokens - 1), id="num-tokens"),
    ],
)
def test_decode_for_another_key_raises(other):
    with pytest.raises(CorruptObject):
        _decode(VALID, other)


# ---------------------------------------------------------------- corruption


def _with_header(data: bytes, **fields) -> bytes:
    """``data`` with header fields rewritten and the header CRC recomputed,
    as a buggy or foreign writer would produce."""
    offsets = {"version": (8, "<H"), "hsize": (10, "<H"), "flags": (12, "<I"), "ndim": (112, "<B"),
               "num_tokens": (184, "<I"), "payload_len": (188, "<Q")}
    b = bytearray(data)
    for name, value in fields.items():
        off, fmt = offsets[name]
        struct.pack_into(fmt, b, off, value)
    struct.pack_into("<I", b, 252, zlib.crc32(bytes(b[:252])))
    return bytes(b)


@pytest.mark.parametrize(
    "change",
    [{"version": FORMAT_VERSION + 1}, {"version": 0}, {"hsize": 4096}, {"flags": 1}, {"ndim": 0},
     {"ndim": 9}, {"payload_len": 4096}, {"payload_len": 0}, {"payload_len": 2**40}],
)
def test_header_with_a_valid_crc_but_wrong_fields_raises(change):
    with pytest.raises(CorruptObject):
        _decode(_with_header(VALID, **change))


def test_reserved_header_bytes_must_be_zero():
    b = bytearray(VALID)
    b[115] = 1
    struct.pack_into("<I", b, 252, zlib.crc32(bytes(b[:252])))
    with pytest.raises(CorruptObject):
        _decode(bytes(b))


def test_parse_header_refuses_short_input():
    with pytest.raises(CorruptObject):
        parse_header(VALID[: HEADER_STRUCT_SIZE - 1])


def test_zero_length_raises():
    with pytest.raises(CorruptObject):
        decode(memoryview(b""), KEY)


@FUZZ
@given(data=st.binary(min_size=0, max_size=3 * 4096))
def test_random_bytes_never_decode(data):
    with pytest.raises(CorruptObject):
        _decode(data)


@FUZZ
@given(data=st.binary(min_size=0, max_size=8192))
def test_random_bytes_behind_a_valid_header_never_decode(data):
    # Only the payload is random: header checks pass, the checksum must not.
    with pytest.raises(CorruptObject):
        _decode(VALID[:HEADER_BLOCK] + data)


@FUZZ
@given(which=st.sampled_from(["small", "big"]), pos=st.integers(min_value=0), flip=st.integers(1, 255))
def test_flipping_any_byte_is_detected(which, pos, flip):
    valid = VALID if which == "small" else BIG_VALID
    b = bytearray(valid)
    b[pos % len(b)] ^= flip
    with pytest.raises(CorruptObject):
        _decode(bytes(b))


@pytest.mark.parametrize("where", ["first after the header", "last of the header block", "first of the payload's padding",
                                   "last of the payload's padding"])
def test_a_nonzero_byte_in_either_padding_is_detected(where):
    """Neither checksum covers the padding: only the reader's zero check does."""
    end = HEADER_BLOCK + len(BIG_PAYLOAD)
    pos = {"first after the header": HEADER_STRUCT_SIZE, "last of the header block": HEADER_BLOCK - 1,
           "first of the payload's padding": end, "last of the payload's padding": len(BIG_VALID) - 1}[where]
    b = bytearray(BIG_VALID)
    assert b[pos] == 0
    b[pos] = 1
    with pytest.raises(CorruptObject, match="padding"):
        _decode(bytes(b))


@FUZZ
@given(which=st.sampled_from(["small", "big"]), length=st.integers(min_value=0))
def test_truncation_at_any_length_is_detected(which, length):
    valid = VALID if which == "small" else BIG_VALID
    with pytest.raises(CorruptObject):
        _decode(valid[: length % len(valid)])


@FUZZ
@given(which=st.sampled_from(["small", "big"]), length=st.integers(min_value=0))
def test_short_read_into_a_full_buffer_is_detected(which, length):
    # A file that read short leaves the rest of the (zeroed) buffer unwritten.
    valid = VALID if which == "small" else BIG_VALID
    n = length % len(valid)
    buf = alloc(len(valid))
    buf[:n] = valid[:n]
    with pytest.raises(CorruptObject):
        decode(buf, KEY, expect_len=n)


@FUZZ
@given(version=st.integers(0, 2**16 - 1).filter(lambda v: v != FORMAT_VERSION))
def test_any_other_format_version_is_refused(version):
    with pytest.raises(CorruptObject):
        _decode(_with_header(VALID, version=version))


@FUZZ
@given(pos=st.integers(0, 211), value=st.integers(0, 255))
def test_any_header_field_change_with_a_recomputed_crc_is_refused(pos, value):
    b = bytearray(VALID)
    if b[pos] == value:
        return
    b[pos] = value
    struct.pack_into("<I", b, 252, zlib.crc32(bytes(b[:252])))
    with pytest.raises(CorruptObject):
        _decode(bytes(b))


@FUZZ
@given(extra=st.binary(min_size=1, max_size=64))
def test_garbage_after_the_object_is_ignored(extra):
    # Readers allocate whole blocks; what lies past the object is not its business.
    obj = _decode(VALID + extra)
    assert bytes(obj.payload) == payload_for(KEY)
