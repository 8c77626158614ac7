"""The namespace of an engine's KV, from vLLM's configuration: everything
that changes a chunk's bytes (``kvtier.keys.Namespace``).

The weights are named by their content (``identity.py``), the page layout
by what the scheduler side knows of it (vLLM version, platform, attention
kernel variant, block size, the resolved ``KVCacheLayout``); the workers
add the rest once they see their KV tensors (``Settings.with_page``). The
namespace is the model's whatever the TP size: a chunk's shards are named
by (TP size, rank) in ``shard_key``, so that engines of other TP sizes can
find and assemble them.

Threads: none of its own; read once at start-up.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm import identity
from kvtier.keys import Namespace


def engine_namespace(vllm_config: Any, kv_cache_config: Any, kv_layout: str | None, chunk_tokens: int, heads: int,
                     fingerprint: str | None) -> Namespace:
    """The namespace of the engine vLLM configured: its one KV cache
    group, the layout vLLM resolved (``resolved_layout``), ``heads`` KV
    heads in all, ``fingerprint`` as ``model_fingerprint`` takes it. The
    tenant salt is left empty (each request's is added with ``with_salt``)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    return Namespace(
        model=identity.model_name(str(vllm_config.model_config.model)),
        model_fingerprint=model_fingerprint(vllm_config, fingerprint),
        kv_dtype=kv_dtype(spec),
        layout=layout_name(vllm_config, spec, kv_layout),
        num_layers=len(group.layer_names),
        num_kv_heads=heads,
        head_dim=int(spec.head_size),
        chunk_tokens=chunk_tokens,
    )


def kv_dtype(spec: Any) -> str:
    """kvtier's name of the dtype of the KV cache tensors of ``spec``."""
    return str(spec.dtype).removeprefix("torch.")


def resolved_layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """The ``KVCacheLayout`` name vLLM's engine core resolved before building
    connectors (0.30-0.33: on the KV cache config and the cache config)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if name is None:
        return None
    from kvtier.integrations.vllm.layout import LEGACY_NAMES

    name = str(getattr(name, "name", name))  # an enum member in some code paths
    return LEGACY_NAMES.get(name, name)


def layout_name(vllm_config: Any, spec: Any, kv_layout: str | None) -> str:
    """Names what the scheduler side knows of how a block's bytes are
    arranged: vLLM version, platform, CPU attention kernel variant, block
    size and the resolved ``KVCacheLayout``. The workers add the rest (the
    attention backend they run, kernel blocks per block, the page's axes:
    ``Settings.with_page``). Chunks are whole engine pages copied as opaque
    bytes, so two engines share KV only if their pages are laid out
    identically."""
    import vllm
    from vllm.platforms import current_platform

    device = current_platform.device_type
    variant = "default"
    if device == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            variant = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
        except Exception as exc:  # an unknown ISA must not share with a known one
            variant = f"unknown:{type(exc).__name__}"
    return f"vllm{vllm.__version__}/{device}/{variant}/bs{spec.block_size}/{kv_layout or 'unresolved'}"


def model_fingerprint(vllm_config: Any, mode: str | None = None) -> str:
    """Identity of the weights from their content (``identity.py``):
    ``mode`` None samples the weight files, ``"full"`` hashes every byte
    (cached); any other string is the fingerprint itself. A hub id is read
    from the snapshot vLLM downloaded (ConfigError where there is none and
    no commit is pinned)."""
    if mode not in (None, "", "full"):
        return str(mode)
    mc, lc = vllm_config.model_config, vllm_config.load_config
    return identity.fingerprint(
        str(mc.model), revision=mc.revision, load_format=str(getattr(lc, "load_format", "")),
        dtype=str(mc.dtype), quantization=mc.quantization, full=mode == "full",
        download_dir=getattr(lc, "download_dir", None))
