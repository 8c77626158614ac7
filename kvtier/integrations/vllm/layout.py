"""Moving whole engine blocks between vLLM's KV cache tensors and chunk payloads.

A chunk of ``chunk_tokens`` tokens spans ``chunk_tokens / block_size`` engine
blocks. Its payload is those blocks' pages for every layer, copied as opaque
bytes (a page's inner arrangement is the attention kernel's business: on CPU
the K tile is transposed, for instance), shaped ``[layers, blocks, *page]``.

Layouts are found from the tensors ``register_kv_caches`` receives, never
assumed:

- ``block-major``: ``kv[block]`` is one contiguous page (CPU attention:
  ``[num_blocks, kv_heads, block_size, 2*head_dim]``; FlashInfer NHD).
- ``kv-major``: ``kv[0][block]`` and ``kv[1][block]`` are the K and V pages
  (FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]``).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from kvtier.errors import ConfigError


class BlockLayout:
    name = "abstract"
    # Axis of a chunk payload along which KV heads lie, where the layout keeps
    # each head's data apart (then a chunk can be cut into or assembled from
    # tensor-parallel shards of other sizes); None where it does not.
    head_axis: int | None = None

    def __init__(self, layers: Sequence[torch.Tensor]):
        self.layers = list(layers)
        self.dtype = self.layers[0].dtype
        self.device = self.layers[0].device

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def leading_blocks(self, chunk: torch.Tensor, n: int) -> torch.Tensor:
        """View of the first ``n`` blocks of a chunk payload."""
        raise NotImplementedError

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` of every layer into ``out``."""
        raise NotImplementedError

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, first: int = 0) -> None:
        """Copy ``src`` (``chunk_shape(len(block_ids))``) into the pages of
        ``block_ids[first:]``; the first ``first`` blocks are left alone (the
        engine already holds them)."""
        raise NotImplementedError

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)


class BlockMajor(BlockLayout):
    """On the host, pages are copied with ``memmove`` (no torch kernels: those
    run on OpenMP teams, and a second team in a loader thread fights the
    engine's own for the cores; measured here: 1.5 s instead of milliseconds
    for an 8 MiB load while the engine computed)."""

    name = "block-major"

    def __init__(self, layers):
        super().__init__(layers)
        first = self.layers[0]
        self.esize = first.element_size()
        self.page_bytes = first[0].numel() * self.esize
        self.host = first.device.type == "cpu" and all(
            t.stride(0) * self.esize >= self.page_bytes and t[0].is_contiguous() for t in self.layers
        )
        # CPU attention pages are [kv heads, block size, 2 x head dim]: heads
        # are the page's outer axis, axis 2 of a chunk [layers, blocks, *page].
        if self.host and first.dim() == 4:
            self.head_axis = 2

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (len(self.layers), num_blocks, *self.layers[0].shape[1:])

    def leading_blocks(self, chunk, n):
        return chunk[:, :n]

    def gather(self, block_ids, out) -> None:
        if self.host and out.device.type == "cpu":
            self._memmove(block_ids, out, 0, to_engine=False)
            return
        idx = self._index(block_ids)
        for layer, dst in zip(self.layers, out):
            _select(layer, idx, dst)

    def scatter(self, block_ids, src, first: int = 0) -> None:
        if self.host and src.device.type == "cpu":
            self._memmove(block_ids, src, first, to_engine=True)
            return
        idx = self._index(block_ids[first:])
        for layer, part in zip(self.layers, src):
            layer.index_copy_(0, idx, part[first:].to(self.device, non_blocking=False))

    def _memmove(self, block_ids, chunk: torch.Tensor, first: int, to_engine: bool) -> None:
        """Page copies between engine blocks and a ``[layers, blocks, *page]``
        host tensor (any view whose pages are contiguous)."""
        if chunk[0, 0].numel() * self.esize != self.page_bytes or not chunk[0, 0].is_contiguous():
            raise ValueError("chunk pages are not contiguous")
        es, pb = self.esize, self.page_bytes
        c_base, c_l, c_b = chunk.data_ptr(), chunk.stride(0) * es, chunk.stride(1) * es
        for li, layer in enumerate(self.layers):
            e_base, e_b = layer.data_ptr(), layer.stride(0) * es
            for j in range(first, len(block_ids)):
                engine = e_base + block_ids[j] * e_b
                mine = c_base + li * c_l + j * c_b
                if to_engine:
                    ctypes.memmove(engine, mine, pb)
                else:
                    ctypes.memmove(mine, engine, pb)


class KVMajor(BlockLayout):
    name = "kv-major"

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (len(self.layers), 2, num_blocks, *self.layers[0].shape[2:])

    def leading_blocks(self, chunk, n):
        return chunk[:, :, :n]

    def gather(self, block_ids, out) -> None:
        idx = self._index(block_ids)
        for layer, dst in zip(self.layers, out):
            for kv in range(2):
                _select(layer[kv], idx, dst[kv])

    def scatter(self, block_ids, src, first: int = 0) -> None:
        idx = self._index(block_ids[first:])
        for layer, part in zip(self.layers, src):
            for kv in range(2):
                layer[kv].index_copy_(0, idx, part[kv][first:].to(self.device))


def _select(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = src[idx], straight into ``dst`` when both live on the host."""
    if src.device == dst.device:
        torch.index_select(src, 0, idx, out=dst)
    else:
        dst.copy_(src.index_select(0, idx))


def detect(layers: Sequence[torch.Tensor], num_blocks: int) -> BlockLayout:
    first = layers[0]
    for t in layers:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigError("kv_caches", "layers have different KV cache shapes or dtypes", "kvtier needs one uniform KV cache group")
    if first.shape[0] == num_blocks and all(t[0].is_contiguous() for t in layers):
        return BlockMajor(layers)
    if first.dim() >= 3 and first.shape[0] == 2 and first.shape[1] == num_blocks:
        return KVMajor(layers)
    raise ConfigError(
        "kv_caches",
        f"unrecognised KV cache layout {tuple(first.shape)} for {num_blocks} blocks",
        "this attention backend is not supported yet; please report it with the shape",
    )
