"""Small models built on the spot, without any download.

- ``build_checkpoint``: a random-init checkpoint saved with transformers
  (Llama or Qwen2 shape, fp32). Its logits are not flat, so greedy output is
  sensitive to every bit of KV: what correctness tests need.
- ``build_config_only``: a config.json only, for vLLM's ``load_format="dummy"``
  (random weights at start-up): what timing runs need, at real model shapes.
- ``resolve_dtype``: the dtype dummy weights get on this host (``auto``).

Head dim must be >= 32 for vLLM's CPU attention.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PRESETS = {
    # name: (architecture, layers, hidden, heads, kv heads, intermediate, vocab)
    "tiny-llama": ("llama", 2, 128, 4, 2, 256, 512),
    "tiny-qwen2": ("qwen2", 2, 128, 4, 2, 256, 512),
    "qwen2.5-0.5b": ("qwen2", 24, 896, 14, 2, 4864, 151936),
}


def _hf_config(preset: str, max_len: int):
    from transformers import LlamaConfig, Qwen2Config

    arch, layers, hidden, heads, kv_heads, inter, vocab = PRESETS[preset]
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    return LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)


def build_checkpoint(preset: str, out: str | Path, seed: int = 0, max_len: int = 8192) -> Path:
    """Random-init fp32 weights saved as a normal checkpoint (seconds for tiny presets)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    torch.manual_seed(seed)
    cfg = _hf_config(preset, max_len)
    cfg.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    model.save_pretrained(out)
    return out


def build_config_only(preset: str, out: str | Path, max_len: int = 32768, dtype: str = "bfloat16") -> Path:
    """config.json only; run with vLLM ``load_format="dummy"``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _hf_config(preset, max_len).to_dict()
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def resolve_dtype(dtype: str) -> str:
    """``auto``: bfloat16 on a GPU or a CPU with native bfloat16 (AVX512-BF16,
    AMX), float32 elsewhere: an AVX2-only CPU emulates bfloat16 matrix
    products, far slower than float32, so an 8k prefill would take minutes
    instead of seconds."""
    if dtype != "auto":
        return dtype
    if has_cuda():
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and Path("/dev/nvidiactl").exists()
