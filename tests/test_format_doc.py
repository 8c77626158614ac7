"""docs/format.md is enough to write an independent reader.

kvtier writes real objects (``codec.encode`` + ``ObjectDir.write``); this
file then finds and parses them using only ``struct``, ``hashlib``, ``zlib``,
``xxhash`` and what docs/format.md states: namespace digest, root, key and
check chains, shard keys, object names, every header field, the header CRC
and the payload checksum. Nothing on the reading side comes from kvtier.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest
import xxhash

# ---------------------------------------------------------------- the doc's reader

BLOCK = 4096
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}


def f(x: bytes) -> bytes:
    """A field: u64 little-endian byte length, then the bytes."""
    return struct.pack("<Q", len(x)) + x


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def namespace_digest(pairs: list[tuple[str, object]]) -> bytes:
    data = f(b"kvtier-ns")
    for name, value in pairs:
        data += f(name.encode("ascii")) + f(str(value).encode("utf-8"))
    return hashlib.sha256(data).digest()


def chain(ns: bytes, tokens: list[int], chunk_tokens: int) -> list[tuple[bytes, bytes, int]]:
    """(key_i, check_i, n_i) of every chunk, the last partial one included."""
    key = hashlib.sha256(f(b"kvtier-root") + f(ns)).digest()  # key_{-1}
    check = blake2b_128(f(b"kvtier-check") + f(ns))  # check_{-1}
    out = []
    for start in range(0, len(tokens), chunk_tokens):
        ids = tokens[start : start + chunk_tokens]
        body = f(u64(len(ids))) + f(b"".join(struct.pack("<I", t) for t in ids))
        key = hashlib.sha256(f(b"kvtier-chunk") + f(key) + body).digest()
        check = blake2b_128(f(b"kvtier-check") + f(check) + body)
        out.append((key, check, len(ids)))
    return out


def shard(key: bytes, check: bytes, ns: bytes, rank: int, tp_size: int) -> tuple[bytes, bytes, bytes]:
    tag = f(b"kvtier-shard") + f(u64(tp_size)) + f(u64(rank))
    return hashlib.sha256(tag + f(key)).digest(), blake2b_128(tag + f(check)), hashlib.sha256(tag + f(ns)).digest()


def object_path(root, key: bytes, ns: bytes):
    return root / "kvtier-v1" / "objects" / ns[:8].hex() / key[:1].hex() / (key.hex() + ".kvc")


def parse(data: bytes) -> dict:
    """Every header field at the doc's offset, each checked as the doc says."""
    assert len(data) >= BLOCK
    (crc,) = struct.unpack_from("<I", data, 252)
    assert crc == zlib.crc32(data[:252]), "header CRC"
    assert data[0:8] == b"KVTCHUNK"
    version, hsize, flags = struct.unpack_from("<HHI", data, 8)
    assert (version, hsize, flags) == (2, 256, 0)
    key, check, ns = data[16:48], data[48:64], data[64:96]
    dtype = data[96:112].rstrip(b"\0").decode("ascii")
    ndim = data[112]
    assert data[113:120] == bytes(7), "reserved"
    shape8 = struct.unpack_from("<8Q", data, 120)
    (num_tokens,) = struct.unpack_from("<I", data, 184)
    (n,) = struct.unpack_from("<Q", data, 188)
    checksum = data[196:212]
    key_id, nonce, tag = data[212:220], data[220:236], data[236:252]
    assert 1 <= ndim <= 8 and all(d >= 1 for d in shape8[:ndim]) and not any(shape8[ndim:])
    shape = shape8[:ndim]
    prod = 1
    for d in shape:
        prod *= d
    assert 1 <= n <= 2**32 and n == prod * DTYPE_SIZES[dtype]
    object_len = BLOCK + -(-n // BLOCK) * BLOCK
    assert len(data) == object_len, "exactly the object's bytes"
    assert data[256:BLOCK] == bytes(BLOCK - 256), "header padding"
    assert data[BLOCK + n :] == bytes(object_len - BLOCK - n), "payload padding"
    payload = data[BLOCK : BLOCK + n]
    # XXH3-128, seed 0, canonical form: the 128-bit value big endian.
    assert checksum == xxhash.xxh3_128_intdigest(payload, seed=0).to_bytes(16, "big"), "payload checksum"
    return dict(key=key, check=check, ns=ns, dtype=dtype, shape=shape, num_tokens=num_tokens, payload=payload,
                key_id=key_id, nonce=nonce, tag=tag, head=data[:236])


def seal_of(cluster_key: bytes, head: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """The doc's seal: (key id, tag) of an object under ``cluster_key``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key_id = hashlib.sha256(f(b"kvtier-key-id") + f(cluster_key)).digest()[:8]
    k_obj = hashlib.blake2b(f(b"kvtier-seal") + f(head), digest_size=32, key=cluster_key).digest()
    return key_id, AESGCM(k_obj).encrypt(bytes(12), b"", payload)


# ---------------------------------------------------------------- the objects kvtier writes

NS_FIELDS = [  # the doc's order
    ("model", "org/model-7B"),
    ("model_fingerprint", "sha256:0123abcd"),
    ("kv_dtype", "bfloat16"),
    ("layout", "vllm-cpu:LKHTD"),
    ("num_layers", 2),
    ("num_kv_heads", 2),
    ("head_dim", 8),
    ("chunk_tokens", 4),
    ("tp_size", 2),
    ("tp_rank", 0),
    ("tenant_salt", "tenant-\u00fc"),  # non-ASCII: its UTF-8 enters the digest
    ("format_version", 2),
]
TOKENS = [0, 1, 2**32 - 1, 7, 42, 65536]  # a full chunk of 4, then a partial chunk of 2


def _payload(nbytes: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(nbytes))


@pytest.fixture
def written(tmp_path):
    """kvtier's own writer: both chunks of TOKENS, and rank 0's and rank 1's
    shards of the last chunk. Returns the root and [(what, shape, payload)]."""
    from kvtier.codec import encode
    from kvtier.keys import Namespace, chunk_keys, shard_key
    from kvtier.tiers.dir.files import ObjectDir

    ns = Namespace(**dict(NS_FIELDS))
    odir = ObjectDir(tmp_path, "test")
    out = []
    keys = chunk_keys(ns, TOKENS)
    for key in keys:
        shape = (2, 2, 2, key.num_tokens, 8)  # layers, K/V, heads, tokens, head dim
        payload = _payload(2 * 2 * 2 * key.num_tokens * 8 * 2)
        odir.write(encode(key, "bfloat16", shape, payload), key, fsync=False)
        out.append(("chunk", shape, payload))
    for rank in range(2):
        key = shard_key(keys[-1], rank, 2)
        shape = (2, 2, 1, keys[-1].num_tokens, 8)  # one head per rank
        payload = _payload(2 * 2 * 1 * keys[-1].num_tokens * 8 * 2)[::-1]
        odir.write(encode(key, "bfloat16", shape, payload), key, fsync=False)
        out.append((f"shard{rank}", shape, payload))
    return tmp_path, out


def test_objects_parse_with_the_doc_alone(written):
    root, objs = written
    nsd = namespace_digest(NS_FIELDS)
    chunks = chain(nsd, TOKENS, chunk_tokens=4)
    assert [n for _, _, n in chunks] == [4, 2]
    last_key, last_check, last_n = chunks[-1]
    expected = [(k, c, nsd, n) for k, c, n in chunks]
    expected += [(*shard(last_key, last_check, nsd, rank, 2), last_n) for rank in range(2)]

    paths = set()
    for (key, check, ns, n), (_, shape, payload) in zip(expected, objs):
        path = object_path(root, key, ns)
        paths.add(path)
        h = parse(path.read_bytes())
        assert (h["key"], h["check"], h["ns"], h["num_tokens"]) == (key, check, ns, n)
        assert (h["dtype"], h["shape"], h["payload"]) == ("bfloat16", shape, payload)
    # Nothing else was written under objects/ (the names are fully specified).
    assert set(p for p in (root / "kvtier-v1" / "objects").rglob("*") if p.is_file()) == paths
    # Shards are objects of their own: other names, checks and namespaces.
    assert len({e[0] for e in expected}) == len({e[1] for e in expected}) == 4
    assert len({e[2] for e in expected}) == 3


def test_sealed_objects_verify_with_the_doc_alone(tmp_path):
    """An object sealed by kvtier's store, checked with the doc's seal
    (SHA-256 key id, BLAKE2b-256 per-object key, AES-256-GCM tag of an empty
    plaintext with the payload as associated data)."""
    from kvtier.codec import encode, seal
    from kvtier.auth import Keyring
    from kvtier.keys import Namespace, chunk_keys

    cluster_key = bytes(range(32))
    key = chunk_keys(Namespace(**dict(NS_FIELDS)), TOKENS)[0]
    payload = _payload(2 * 2 * 2 * 4 * 8 * 2)
    obj = encode(key, "bfloat16", (2, 2, 2, 4, 8), payload)
    seal(obj, Keyring([cluster_key]))
    h = parse(bytes(obj.buf))
    assert h["nonce"] != bytes(16)
    assert (h["key_id"], h["tag"]) == seal_of(cluster_key, h["head"], payload)
    # The tag covers the header: the same payload under another nonce is another tag.
    other = h["head"][:220] + bytes(16)
    assert seal_of(cluster_key, other, payload)[1] != h["tag"]


def test_unsealed_objects_have_zero_seal_fields(written):
    root, _ = written
    for path in (root / "kvtier-v1" / "objects").rglob("*.kvc"):
        h = parse(path.read_bytes())
        assert (h["key_id"], h["nonce"], h["tag"]) == (bytes(8), bytes(16), bytes(16))


def test_the_checksums_are_the_documented_ones():
    """CRC-32/ISO-HDLC and XXH3-128's canonical (big-endian) bytes, as stated."""
    assert zlib.crc32(b"123456789") == 0xCBF43926
    data = b"kvtier"
    h = xxhash.xxh3_128_intdigest(data)
    assert xxhash.xxh3_128_digest(data) == struct.pack(">QQ", h >> 64, h & (2**64 - 1))


def test_redis_and_s3_names_follow_the_doc(monkeypatch):
    """The tiers' own naming functions against the doc's names (no server)."""
    pytest.importorskip("redis")
    pytest.importorskip("botocore")
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers.redis.config import RedisConfig
    from kvtier.tiers.redis.tier import RedisTier
    from kvtier.tiers.s3.config import S3Config
    from kvtier.tiers.s3.tier import S3Tier

    key = chunk_keys(Namespace(**dict(NS_FIELDS)), TOKENS)[0]
    nsd = namespace_digest(NS_FIELDS)
    kd = chain(nsd, TOKENS, 4)[0][0]
    ns_hex, key_hex = nsd[:8].hex(), kd.hex()
    assert ns_hex == ns_hex.lower() and len(ns_hex) == 16 and len(key_hex) == 64

    redis_tier = RedisTier(RedisConfig(address="127.0.0.1:1", capacity=1 << 30))  # connects on first use only
    try:
        assert redis_tier._name(key) == f"kvtier:v1:{ns_hex}:{key_hex}".encode()
    finally:
        redis_tier.close()

    monkeypatch.setattr(S3Tier, "_client", lambda self: None)  # names only: no boto3 client
    for location, name in [
        ("bucket/pre/fix/", f"pre/fix/kvtier-v1/{ns_hex}/{key_hex}"),
        ("bucket", f"kvtier-v1/{ns_hex}/{key_hex}"),
    ]:
        s3_tier = S3Tier(S3Config(location=location, capacity=1 << 30))
        try:
            assert s3_tier.bucket == "bucket"
            assert s3_tier.object_name(key) == name
        finally:
            s3_tier.close()
