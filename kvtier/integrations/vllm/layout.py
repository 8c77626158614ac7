"""Moving whole engine blocks between vLLM's KV cache tensors and chunk payloads.

A chunk of ``chunk_tokens`` tokens spans ``chunk_tokens / block_size`` engine
blocks. Its payload is those blocks' pages for every layer, copied as
opaque bytes (a page's inner arrangement within a head is the attention
kernel's business: the CPU kernel tiles it per ISA, for instance), shaped
``[layers, blocks, *page]`` where ``page`` lists the page's axes in the
order they lie in memory.

What ``register_kv_caches`` receives, in every vLLM from 0.30 to 0.33 (read
in their sources; see docs/vllm.md): one int8 buffer for all layers, and per
layer a 4-D view ``[B, H, N, C]`` (blocks, KV heads, tokens of a block,
content: K then V of a head) whose strides follow the engine's
``KVCacheLayout``: one of ``LBHNC`` (CPU attention; FlashInfer on SM100),
``LBNHC`` (FlashAttention, Triton, FlashInfer elsewhere, MLA), ``LHBNC``
(ROCm), ``BLHNC``, ``BLNHC``, ``BHLNC``, each letter an axis, outermost
first (L: layer). Where ``--block-size`` is larger than the kernel's block,
the view counts kernel blocks: ``B * r`` of them, scheduler block ``b``
being kernel blocks ``b*r .. b*r + r - 1``.

The layout is read from the views' strides, never assumed (``detect``), and
named (``PageLayout.name``) so that engines whose pages differ never share
a key (the worker checks it against the layout vLLM resolved; the scheduler
puts it in the namespace). A scheduler block's page in one layer is a few
dense runs of memory: one for every layout but ``LHBNC`` and ``BHLNC``
(one per head there).
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from kvtier.errors import ConfigError

# vLLM's logical axes of a layer view, and the kernel-block axis kvtier adds
# when a scheduler block holds several kernel blocks.
_AXES = "BHNC"
SPLIT = "R"


class PageLayout:
    """The pages of one uniform KV cache group, found from its views' strides.

    ``page`` is the page's axes in memory order (subset of ``R H N C``, each
    with its size and element stride); a chunk payload is
    ``[layers, blocks, *page sizes]``. ``runs`` (byte offsets within a
    block's page, one dense run of ``run_bytes`` each) is what one block of
    one layer occupies."""

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, order: str, split: int,
                 page: list[tuple[str, int, int]], block_stride: int, run_dims: int):
        self.layers = list(layers)
        self.dtype = self.layers[0].dtype
        self.device = self.layers[0].device
        self.esize = self.layers[0].element_size()
        self.num_blocks = num_blocks
        self.order = order  # vLLM's KVCacheLayout name, e.g. "LBNHC"
        self.split = split  # kernel blocks per scheduler block
        self.page = page
        self.block_stride = block_stride  # elements between two scheduler blocks of a layer
        self.page_shape = tuple(size for _, size, _ in page)
        self.page_elems = 1
        for s in self.page_shape:
            self.page_elems *= s
        self.page_bytes = self.page_elems * self.esize
        # Runs: the outer ``len(page) - run_dims`` axes iterate, the inner
        # ``run_dims`` axes are one dense range each.
        inner = page[len(page) - run_dims:]
        self.run_elems = 1
        for _, size, _ in inner:
            self.run_elems *= size
        self.run_bytes = self.run_elems * self.esize
        offsets = [0]
        for _, size, stride in page[: len(page) - run_dims]:
            offsets = [o + i * stride for o in offsets for i in range(size)]
        self.run_offsets = [o * self.esize for o in offsets]  # bytes from the block's first element
        self.host = self.device.type == "cpu"
        # KV heads lie along this axis of a chunk payload, each head's data
        # apart: a chunk can be cut into, or assembled from, tensor-parallel
        # shards of other sizes.
        names = [n for n, _, _ in page]
        self.head_axis: int | None = 2 + names.index("H")
        self.name = order + (f"/r{split}" if split > 1 else "")

    def describe(self) -> str:
        """What decides a payload's bytes besides dtype: the layout, the
        kernel split and the page's axes in memory order with their sizes,
        heads as ``h``: a rank's head count follows from the TP size, which
        names each shard (``shard_key``), so engines of other TP sizes keep
        one namespace and can assemble each other's shards."""
        sizes = "x".join("h" if n == "H" else str(size) for n, size, _ in self.page)
        return f"{self.name}/page{''.join(n for n, _, _ in self.page)}{sizes}"

    def chunk_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (len(self.layers), num_blocks, *self.page_shape)

    def leading_blocks(self, chunk: torch.Tensor, n: int) -> torch.Tensor:
        """View of the first ``n`` blocks of a chunk payload."""
        return chunk[:, :n]

    # ------------------------------------------------------------ copies
    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` of every layer into ``out``
        (``chunk_shape(len(block_ids))``)."""
        if self.host and out.device.type == "cpu":
            self._memmove(block_ids, out, 0, to_engine=False)
            return
        idx = self._index(block_ids)
        for li, dst in enumerate(out):
            pages = self._pages(li).index_select(0, idx)
            dst.copy_(pages, non_blocking=dst.device.type == "cpu" and dst.is_pinned())

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, first: int = 0) -> None:
        """Copy ``src`` (``chunk_shape(len(block_ids))``, or its leading
        blocks) into the pages of ``block_ids[first:]``; the first ``first``
        blocks are left alone (the engine already holds them)."""
        if self.host and src.device.type == "cpu":
            self._memmove(block_ids, src, first, to_engine=True)
            return
        idx = self._index(block_ids[first:])
        for li, part in enumerate(src):
            self._pages(li).index_copy_(0, idx, part[first:].to(self.device, non_blocking=part.is_pinned()))

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _pages(self, li: int) -> torch.Tensor:
        """Layer ``li`` as ``[blocks, *page]``: a strided view of the engine's
        buffer (writes through)."""
        t = self.layers[li]
        return t.as_strided((self.num_blocks, *self.page_shape), (self.block_stride, *(s for _, _, s in self.page)),
                            t.storage_offset())

    def _memmove(self, block_ids, chunk: torch.Tensor, first: int, to_engine: bool) -> None:
        """Run copies between engine pages and a ``[layers, blocks, *page]``
        host tensor whose pages are contiguous. ``memmove`` and not a torch
        kernel: those run on OpenMP teams, and a second team in a loader
        thread fights the engine's own for the cores (measured: 1.5 s
        instead of milliseconds for an 8 MiB load while the engine ran)."""
        if chunk[0, 0].numel() != self.page_elems or not chunk[0, 0].is_contiguous():
            raise ValueError("chunk pages are not contiguous")
        es, rb = self.esize, self.run_bytes
        c_base, c_l, c_b = chunk.data_ptr(), chunk.stride(0) * es, chunk.stride(1) * es
        b_bytes = self.block_stride * es
        runs = list(enumerate(self.run_offsets))
        for li, layer in enumerate(self.layers):
            e_base = layer.data_ptr()
            for j in range(first, len(block_ids)):
                engine = e_base + block_ids[j] * b_bytes
                mine = c_base + li * c_l + j * c_b
                for k, off in runs:
                    if to_engine:
                        ctypes.memmove(engine + off, mine + k * rb, rb)
                    else:
                        ctypes.memmove(mine + k * rb, engine + off, rb)


def _refuse(what: str, fix: str = "report it with the shapes and strides in the message") -> ConfigError:
    return ConfigError("kv_caches", what, fix)


def _distinct_layers(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in layers:
        k = (t.data_ptr(), t.stride())
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def detect(layers: Sequence[torch.Tensor], num_blocks: int, expected: str | None = None) -> PageLayout:
    """The page layout of ``layers`` (one view per layer, ``num_blocks``
    scheduler blocks), checked against ``expected`` (the ``KVCacheLayout``
    vLLM resolved, or a legacy alias), if given. Refuses, naming what to
    change, anything it cannot copy exactly."""
    first = layers[0]
    for t in layers:
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise _refuse("layers have different KV cache shapes, dtypes or strides",
                          "kvtier needs one uniform KV cache group")
    if first.dim() != 4:
        raise _refuse(f"unrecognised KV cache view {tuple(first.shape)} (vLLM 0.30-0.33 hand connectors "
                      "[blocks, heads, tokens, content] views)")
    kb = first.shape[0]
    if num_blocks <= 0 or kb % num_blocks:
        raise _refuse(f"KV cache view {tuple(first.shape)} does not hold {num_blocks} blocks, nor a multiple of them")
    split = kb // num_blocks
    sizes, strides = list(first.shape), list(first.stride())
    if any(s < 0 for s in strides):
        raise _refuse(f"negative strides {tuple(strides)}")
    # Per scheduler block: axes R (kernel blocks, if split), H, N, C.
    axes = [("H", sizes[1], strides[1]), ("N", sizes[2], strides[2]), ("C", sizes[3], strides[3])]
    if split > 1:
        axes.insert(0, (SPLIT, split, strides[0]))
    block_stride = split * strides[0]

    # Where the layer axis lies: the distance between two layers' views.
    ptrs = sorted({t.data_ptr() for t in _distinct_layers(layers)})
    layer_stride = (ptrs[1] - ptrs[0]) // first.element_size() if len(ptrs) > 1 else None
    order = _order(axes, block_stride, layer_stride, expected)
    page = _sorted(axes, order)
    # The page's axes must tile memory without overlap; find the dense
    # innermost axes (one run each).
    _check_disjoint(page + [("B", num_blocks, block_stride)], first)
    run_dims, want = 0, 1
    for _, size, stride in reversed(page):
        if stride != want and size > 1:
            break
        run_dims += 1
        want *= size
    if run_dims == 0:
        raise _refuse(f"KV cache content axis is not dense (strides {tuple(strides)})")
    return PageLayout(layers, num_blocks, order, split, page, block_stride, run_dims)


def _sorted(axes, order: str):
    """The page axes in memory order (``order``'s letters, R before the
    page axes: kernel blocks are a scheduler block's outermost part)."""
    rank = {c: i for i, c in enumerate(SPLIT + "".join(c for c in order if c in "HNC"))}
    return sorted(axes, key=lambda a: rank[a[0]])


def _order(axes, block_stride: int, layer_stride: int | None, expected: str | None) -> str:
    """The ``KVCacheLayout`` name the strides show (``expected`` where
    size-1 axes leave it open), or a refusal if they show none."""
    from_strides = {a[0]: a[2] for a in axes if a[1] > 1}
    from_strides["B"] = block_stride
    if layer_stride is not None:
        from_strides["L"] = layer_stride
    expected = LEGACY_NAMES.get(expected or "", expected) or None
    if expected is not None and expected not in _LAYOUTS:
        raise _refuse(f"vLLM resolved KV cache layout {expected!r}, which kvtier does not know",
                      f"set VLLM_KV_CACHE_LAYOUT to one of {', '.join(_LAYOUTS)}")
    found = [o for o in _LAYOUTS if _consistent(o, from_strides)]
    if expected is not None:
        if expected in found:
            return expected
        raise _refuse(f"KV cache strides {from_strides} do not show layout {expected}, which vLLM resolved",
                      "report it: kvtier reads the layout from the views, and vLLM's setting must agree")
    if not found:
        raise _refuse(f"no known KV cache layout has strides {from_strides}",
                      "set VLLM_KV_CACHE_LAYOUT=LBHNC (or LBNHC), or report the backend")
    return found[0]


# vLLM's KVCacheLayout members (v1/kv_cache_layout.py, identical in 0.30-0.33)
# and the legacy names its settings still accept.
_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LEGACY_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}


def _consistent(order: str, strides: dict[str, int]) -> bool:
    """Whether axes with known strides are ordered as ``order`` says
    (outermost first: strictly larger strides)."""
    known = [strides[c] for c in order if c in strides]
    return all(a > b for a, b in zip(known, known[1:]))


def _check_disjoint(axes, t: torch.Tensor) -> None:
    """Every element of every block's page at its own address: sorted by
    stride, each axis must step past everything the smaller axes span."""
    span = 1
    for name, size, stride in sorted((a for a in axes if a[1] > 1), key=lambda a: a[2]):
        if stride < span:
            raise _refuse(f"KV cache axes overlap in memory (shape {tuple(t.shape)}, strides {tuple(t.stride())})")
        span = stride * size
