"""Chunk keys: token ids -> prefix-chained, namespace-rooted SHA-256 digests.

    ns       = SHA-256("kvtier-ns" ‖ namespace fields)
    key_{-1} = SHA-256("kvtier-root" ‖ ns)
    key_i    = SHA-256("kvtier-chunk" ‖ key_{i-1} ‖ len ‖ token ids of chunk i)

Every field is length-prefixed (u64 little endian) so that no two different
field sequences serialise to the same bytes. Token ids are packed as u32
little endian. Python's ``hash()`` is never used: keys are identical across
processes, machines and PYTHONHASHSEED.

Each key also carries ``check``, an independent 16-byte BLAKE2b chain over the
same input. Objects echo it in their header, so a reader detects a collision
of the (possibly truncated) naming digest instead of serving foreign KV.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, fields
from typing import NamedTuple, Sequence

from kvtier.version import FORMAT_VERSION

_U64 = struct.Struct("<Q")
DIGEST_BYTES = 32
CHECK_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1

# Test hook (reliability suite): number of bytes of the naming digest to keep;
# the rest is zeroed, which forces collisions. Never set outside tests.
_TRUNCATE_DIGEST_FOR_TESTS: int | None = None


def _field(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a chunk's KV.

    Two requests share KV only if every field matches. ``layout`` names the
    payload arrangement (e.g. ``"vllm-cpu:LKHTD"``); the shape fields pin the
    sizes. ``tenant_salt`` is vLLM's ``cache_salt``; it only ever enters the
    digest, never a file or key name.
    """

    model: str
    model_fingerprint: str
    kv_dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_tokens: int = 256
    tp_size: int = 1
    tp_rank: int = 0
    tenant_salt: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Namespace.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"Namespace.tp_rank {self.tp_rank} not in [0, {self.tp_size})")

    def serialise(self) -> bytes:
        parts = [_field(b"kvtier-ns")]
        for f in fields(self):
            parts.append(_field(f.name.encode()))
            parts.append(_field(str(getattr(self, f.name)).encode("utf-8", "surrogatepass")))
        return b"".join(parts)

    def digest(self) -> bytes:
        return hashlib.sha256(self.serialise()).digest()

    def with_salt(self, salt: str | None) -> "Namespace":
        from dataclasses import replace

        return replace(self, tenant_salt=salt or "")


class ChunkKey(NamedTuple):
    """Identity of one chunk: where it is named and what its header must echo."""

    digest: bytes  # 32 bytes; names the object in every tier
    check: bytes  # 16 bytes; independent chain echoed in the object header
    ns: bytes  # namespace digest, echoed in the header
    num_tokens: int  # tokens in this chunk (the last chunk may be partial)

    @property
    def hex(self) -> str:
        return self.digest.hex()


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]") from exc


def root_key(ns_digest: bytes) -> ChunkKey:
    """The chain state before the first chunk (not itself a chunk's key)."""
    return ChunkKey(
        hashlib.sha256(_field(b"kvtier-root") + _field(ns_digest)).digest(),
        hashlib.blake2b(_field(b"kvtier-check") + _field(ns_digest), digest_size=CHECK_BYTES).digest(),
        ns_digest,
        0,
    )


def next_key(prev: ChunkKey, chunk: Sequence[int]) -> ChunkKey:
    """The key of ``chunk`` following ``prev`` (a chunk key or ``root_key``)."""
    body = _field(_U64.pack(len(chunk))) + _field(_pack_tokens(chunk))
    digest = hashlib.sha256(_field(b"kvtier-chunk") + _field(_full_digest(prev)) + body).digest()
    check = hashlib.blake2b(_field(b"kvtier-check") + _field(prev.check) + body, digest_size=CHECK_BYTES).digest()
    key = ChunkKey(digest, check, prev.ns, len(chunk))
    if _TRUNCATE_DIGEST_FOR_TESTS is not None:
        keep = _TRUNCATE_DIGEST_FOR_TESTS
        truncated = ChunkKey(digest[:keep] + bytes(DIGEST_BYTES - keep), check, prev.ns, len(chunk))
        _FULL[truncated] = digest
        return truncated
    return key


# The chain always continues from the full digest, even when the test hook
# truncates the naming digest. Only the hook needs this map.
_FULL: dict = {}


def _full_digest(prev: ChunkKey) -> bytes:
    if _TRUNCATE_DIGEST_FOR_TESTS is None:
        return prev.digest
    return _FULL.get(prev, prev.digest)


def chunk_keys(ns: Namespace, tokens: Sequence[int], *, ns_digest: bytes | None = None) -> list[ChunkKey]:
    """Keys of every chunk of ``tokens``, the last partial chunk included."""
    prev = root_key(ns_digest if ns_digest is not None else ns.digest())
    out: list[ChunkKey] = []
    for start in range(0, len(tokens), ns.chunk_tokens):
        prev = next_key(prev, tokens[start : start + ns.chunk_tokens])
        out.append(prev)
    return out


def shard_key(key: ChunkKey, rank: int, tp_size: int) -> ChunkKey:
    """The key of tensor-parallel rank ``rank``'s shard of chunk ``key``.

    Under tensor parallelism every rank holds other KV heads of the same
    tokens, so each rank's shard is an object of its own. The scheduler
    computes one chain for the whole TP group (the namespace's ``tp_size``
    pins the group's size); every rank names and checks its shard by this
    derivation, so that two ranks' shards never share a name, a check or a
    namespace digest (a rank reading another's shard fails verification).
    ``tp_size == 1`` is the chain itself: a single rank holds all heads.
    """
    if tp_size == 1:
        return key
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} not in [0, {tp_size})")
    tag = _field(b"kvtier-shard") + _field(_U64.pack(tp_size)) + _field(_U64.pack(rank))
    return ChunkKey(
        hashlib.sha256(tag + _field(_full_digest(key))).digest(),
        hashlib.blake2b(tag + _field(key.check), digest_size=CHECK_BYTES).digest(),
        hashlib.sha256(tag + _field(key.ns)).digest(),
        key.num_tokens,
    )
