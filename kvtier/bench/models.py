"""KV shapes of common models, for benchmarks and planning.

Bytes per token = layers x 2 (K and V) x KV heads x head dim x dtype size.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.codec import DTYPE_SIZES


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def chunk_shape(self, tokens: int) -> tuple[int, ...]:
        """Payload shape of one chunk: [layers, K/V, kv heads, tokens, head dim]."""
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)


PRESETS = {
    m.name: m
    for m in (
        ModelShape("qwen2.5-0.5b", 24, 2, 64),
        ModelShape("qwen2.5-7b", 28, 4, 128),
        ModelShape("llama-3.1-8b", 32, 8, 128),
        ModelShape("llama-3.1-70b", 80, 8, 128),
        ModelShape("qwen3-coder-480b", 62, 8, 128),
    )
}
