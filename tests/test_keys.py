"""Chunk keys: stable across processes, rooted in every namespace field,
prefix-chained, partial last chunk included."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.keys import Namespace, chunk_keys

REPO = Path(__file__).resolve().parents[1]

GOLDEN_NS = Namespace(
    model="meta-llama/Llama-3.1-8B-Instruct",
    model_fingerprint="sha256:golden",
    kv_dtype="bfloat16",
    layout="vllm-cpu:LKHTD",
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    chunk_tokens=4,
    tp_size=2,
    tp_rank=1,
    tenant_salt="tenant-a",
)
GOLDEN_TOKENS = list(range(10))  # two full chunks of 4 and a partial chunk of 2

# Computed once with format version 2. A change to key derivation, namespace
# serialisation or the format version must change these on purpose.
GOLDEN_NS_DIGEST = "358c4e0151d1544ded61aa8d5fb8b4eb6cd0f6a2e411a30403833da19a9c10b7"
GOLDEN_KEYS = [
    ("bbf10d66d4394948f51537ba98193bb79ad3c26cc6e16b47031ba974173dd94c", "f4c3d572aee88468cb94bd476a283d9a", 4),
    ("1ba1482dd32cfc10a37da466ce3cf8c661b959ee0e1832e81b51bbc13e51877a", "10a065376143deae527794cfa3bc8ea3", 4),
    ("e0be34c9de6bd5f0d2a8254965c34b1cc1a8cb3b9f41410c1bc72cf2995cf1b5", "91bc4d5f6af426f776ccfc1464c36373", 2),
]


def test_golden_vectors():
    assert GOLDEN_NS.digest().hex() == GOLDEN_NS_DIGEST
    keys = chunk_keys(GOLDEN_NS, GOLDEN_TOKENS)
    assert [(k.digest.hex(), k.check.hex(), k.num_tokens) for k in keys] == GOLDEN_KEYS
    assert all(k.ns.hex() == GOLDEN_NS_DIGEST for k in keys)


def _field(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_first_key_follows_the_documented_construction():
    """Re-derive key 0 from the spec (length-prefixed fields, u32 LE tokens,
    SHA-256 chain rooted in the namespace digest), independently of keys.py."""
    ser = _field(b"kvtier-ns")
    for f in dataclasses.fields(Namespace):
        ser += _field(f.name.encode()) + _field(str(getattr(GOLDEN_NS, f.name)).encode())
    nsd = hashlib.sha256(ser).digest()
    root = hashlib.sha256(_field(b"kvtier-root") + _field(nsd)).digest()
    chunk = GOLDEN_TOKENS[:4]
    body = _field(struct.pack("<Q", len(chunk))) + _field(struct.pack("<4I", *chunk))
    key0 = hashlib.sha256(_field(b"kvtier-chunk") + _field(root) + body).digest()
    assert nsd.hex() == GOLDEN_NS_DIGEST
    assert key0.hex() == GOLDEN_KEYS[0][0]


_CHILD = """
import json, sys
from kvtier.keys import Namespace, chunk_keys
ns = Namespace(**json.loads(sys.argv[1]))
print(json.dumps([[k.digest.hex(), k.check.hex(), k.ns.hex(), k.num_tokens]
                  for k in chunk_keys(ns, json.loads(sys.argv[2]))]))
"""


def test_keys_identical_across_processes_and_hash_seeds():
    tokens = list(range(1000, 1010))
    here = [[k.digest.hex(), k.check.hex(), k.ns.hex(), k.num_tokens] for k in chunk_keys(GOLDEN_NS, tokens)]
    ns_json = json.dumps(dataclasses.asdict(GOLDEN_NS))
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, ns_json, json.dumps(tokens)],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        )
        assert json.loads(out.stdout) == here, f"PYTHONHASHSEED={seed}"


def _changed(ns: Namespace, f: dataclasses.Field):
    value = getattr(ns, f.name)
    if isinstance(value, str):
        return value + "x"
    if f.name == "tp_rank":
        return (value + 1) % ns.tp_size
    return value + 1


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Namespace)])
def test_changing_any_namespace_field_changes_every_key(field):
    base = GOLDEN_NS
    f = next(f for f in dataclasses.fields(Namespace) if f.name == field)
    other = dataclasses.replace(base, **{field: _changed(base, f)})
    assert other != base
    tokens = list(range(40))
    a, b = chunk_keys(base, tokens), chunk_keys(other, tokens)
    assert a and b
    digests_a = {k.digest for k in a}
    checks_a = {k.check for k in a}
    for k in b:
        assert k.digest not in digests_a
        assert k.check not in checks_a
        assert k.ns != a[0].ns


def test_salt_changes_keys_and_empty_salt_is_the_default():
    tokens = list(range(8))
    assert chunk_keys(GOLDEN_NS.with_salt("other"), tokens)[0] != chunk_keys(GOLDEN_NS, tokens)[0]
    unsalted = dataclasses.replace(GOLDEN_NS, tenant_salt="")
    assert GOLDEN_NS.with_salt(None) == unsalted
    assert GOLDEN_NS.with_salt("") == unsalted


def test_shared_prefix_shares_leading_keys_then_diverges():
    size = GOLDEN_NS.chunk_tokens
    prefix = list(range(100, 100 + 2 * size + 1))  # two full chunks, one token into the third
    a = chunk_keys(GOLDEN_NS, prefix + [1, 2, 3] + list(range(500, 520)))
    b = chunk_keys(GOLDEN_NS, prefix + [9, 2, 3] + list(range(500, 520)))
    assert len(a) == len(b)
    assert a[:2] == b[:2]
    # The chunk holding the first difference and every later chunk differ,
    # even where their own tokens are equal: keys are chained.
    for ka, kb in zip(a[2:], b[2:]):
        assert ka.digest != kb.digest
        assert ka.check != kb.check


def test_last_partial_chunk_counts():
    size = GOLDEN_NS.chunk_tokens
    tokens = list(range(2 * size + 3))
    keys = chunk_keys(GOLDEN_NS, tokens)
    assert [k.num_tokens for k in keys] == [size, size, 3]
    longer = chunk_keys(GOLDEN_NS, tokens + [77])
    assert longer[:2] == keys[:2]
    assert longer[2].num_tokens == 4 and longer[2].digest != keys[2].digest
    # A partial chunk is not the same chunk as a full chunk with the same head.
    assert chunk_keys(GOLDEN_NS, tokens[:size])[0] == keys[0]
    assert chunk_keys(GOLDEN_NS, tokens[: size - 1])[0].digest != keys[0].digest
    assert chunk_keys(GOLDEN_NS, []) == []


def test_any_sequence_type_gives_the_same_keys():
    tokens = list(range(13))
    assert chunk_keys(GOLDEN_NS, tokens) == chunk_keys(GOLDEN_NS, tuple(tokens)) == chunk_keys(GOLDEN_NS, range(13))


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.5, "7", None])
def test_token_ids_out_of_range_raise_value_error(bad):
    with pytest.raises(ValueError):
        chunk_keys(GOLDEN_NS, [1, 2, bad, 4, 5])


def test_token_id_bounds_are_accepted():
    keys = chunk_keys(GOLDEN_NS, [0, 2**32 - 1])
    assert len(keys) == 1 and keys[0].num_tokens == 2


@pytest.mark.parametrize(
    "change",
    [{"num_layers": 0}, {"num_kv_heads": -1}, {"head_dim": 0}, {"chunk_tokens": 0}, {"tp_size": 0},
     {"tp_rank": 2}, {"tp_rank": -1}],
)
def test_invalid_namespace_is_refused(change):
    with pytest.raises(ValueError):
        dataclasses.replace(GOLDEN_NS, **change)


def test_tp_ranks_shards_of_one_chunk_never_share_a_name_check_or_namespace():
    from kvtier.keys import shard_key

    ns = Namespace("m", "fp", "float16", "l", 2, 4, 8, tp_size=4)
    chain = chunk_keys(ns, list(range(600)))
    for key in chain:
        shards = [shard_key(key, r, 4) for r in range(4)]
        assert len({s.digest for s in shards} | {key.digest}) == 5
        assert len({s.check for s in shards} | {key.check}) == 5
        assert len({s.ns for s in shards} | {key.ns}) == 5
        assert all(s.num_tokens == key.num_tokens for s in shards)
        assert shards == [shard_key(key, r, 4) for r in range(4)]  # deterministic
    # Another TP size's shards are other objects too (heads per rank differ).
    assert shard_key(chain[0], 0, 2).digest != shard_key(chain[0], 0, 4).digest
    assert shard_key(chain[0], 0, 1) == chain[0]  # one rank holds every head
    with pytest.raises(ValueError):
        shard_key(chain[0], 4, 4)
