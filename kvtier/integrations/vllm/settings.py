"""What the connector needs from vLLM's configuration, read once.

``kv_connector_extra_config`` holds kvtier's own settings: ``config`` (a
kvtier config file), any StoreConfig key inline (``tiers``, ``chunk_tokens``,
...), and ``model_fingerprint`` to pin the weights identity explicitly.
Inline keys override the file, which overrides ``KVTIER_*`` variables.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig, load_config
from kvtier.errors import ConfigError
from kvtier.keys import Namespace

SUPPORTED_VLLM = ("0.32.",)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_OWN_KEYS = {"config", "model_fingerprint"}


@dataclass(frozen=True)
class Settings:
    store: StoreConfig
    namespace: Namespace  # tenant salt empty; per request via with_salt
    block_size: int
    num_layers: int
    kv_dtype: str  # kvtier dtype name of the KV cache tensors


def load_settings(vllm_config: Any, kv_cache_config: Any) -> Settings:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ConfigError(
            "vllm", f"vLLM {vllm.__version__} is not a supported version", f"use vLLM {' or '.join(v + 'x' for v in SUPPORTED_VLLM)}"
        )
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
        raise ConfigError(
            "kv_transfer_config.kv_load_failure_policy",
            f"is {ktc.kv_load_failure_policy!r}: a cache miss during a load would fail the request",
            'add "kv_load_failure_policy": "recompute" to --kv-transfer-config',
        )
    extra = dict(ktc.kv_connector_extra_config or {})
    path = extra.pop("config", None)
    fingerprint = extra.pop("model_fingerprint", None)
    store = load_config(path, overrides=extra)

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            "model", f"{len(groups)} KV cache groups (hybrid attention)", "kvtier supports models with one KV cache group"
        )
    spec = groups[0].kv_cache_spec
    block_size = int(spec.block_size)
    if store.chunk_tokens % block_size:
        raise ConfigError(
            "chunk_tokens",
            f"{store.chunk_tokens} is not a multiple of the engine's block size {block_size}",
            f"set chunk_tokens to a multiple of {block_size}, e.g. {max(1, 256 // block_size) * block_size}",
        )
    kv_dtype = str(spec.dtype).removeprefix("torch.")
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    ns = Namespace(
        model=f"{mc.model}@{mc.revision or ''}",
        model_fingerprint=fingerprint or model_fingerprint(vllm_config),
        kv_dtype=kv_dtype,
        layout=layout_name(vllm_config, spec),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        chunk_tokens=store.chunk_tokens,
        tp_size=int(pc.tensor_parallel_size),
        tp_rank=_tp_rank(),
    )
    return Settings(store, ns, block_size, len(groups[0].layer_names), kv_dtype)


def layout_name(vllm_config: Any, spec: Any) -> str:
    """Names everything that decides how a block's bytes are arranged: vLLM
    version, platform, attention kernel variant and block size. Chunks are
    whole engine pages copied as opaque bytes, so two engines share KV only if
    their pages are laid out identically."""
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
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"vllm{vllm.__version__}/{device}/{backend or 'auto'}/{variant}/bs{spec.block_size}/pages"


def model_fingerprint(vllm_config: Any) -> str:
    """Identity of the weights: for a local directory, its config and the
    name, size and mtime of every weight file; otherwise model id and
    revision. Also the load format (dummy weights differ from real ones)."""
    mc = vllm_config.model_config
    h = hashlib.sha256()
    load_format = str(getattr(vllm_config.load_config, "load_format", ""))
    h.update(f"{mc.model}|{mc.revision}|{load_format}|{mc.dtype}|{mc.quantization}".encode())
    root = Path(str(mc.model))
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name == "config.json":
                h.update(p.read_bytes())
            elif p.suffix in _WEIGHT_SUFFIXES:
                st = p.stat()
                h.update(f"{p.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # scheduler process: no model-parallel group; rank 0's keys
        return int(os.environ.get("KVTIER_TP_RANK", "0"))
