"""Page layouts: views built the way vLLM 0.30-0.33 build them
(``create_kv_cache_views`` over one int8 buffer, strides from the
``KVCacheLayout``'s axis order, kernel-split blocks), on CPU tensors. Every
layout must round-trip gather -> scatter byte-exactly, touch no other
block, and carry a name that differs wherever the bytes of a page do."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.layout import detect

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def vllm_views(layout: str, layers: int, blocks: int, heads: int, block_size: int, head_size: int,
               kernel_block: int | None = None, dtype=torch.float32):
    """Per-layer ``[B*r, H, kbs, 2*head_size]`` views of one buffer, as
    vLLM's ``create_kv_cache_views``: byte strides over logical
    ``[L, B, H, N, C]`` in the layout's physical order, a split block's
    stride divided by the ratio (layer-compact layouts only)."""
    es = torch.tensor([], dtype=dtype).element_size()
    kbs = kernel_block or block_size
    r = block_size // kbs
    shape = [layers, blocks * r, heads, kbs, 2 * head_size * es]  # bytes in C, like vLLM
    strides, cur = [0] * 5, 1
    order = ["LBHNC".index(c) for c in layout]
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    if r > 1:
        assert layout.startswith("LB") or layout.startswith("LH")
    buf = torch.zeros(cur, dtype=torch.int8)
    buf.copy_(torch.randint(-128, 128, (cur,), dtype=torch.int8))
    view5 = torch.as_strided(buf, shape, strides)
    return buf, [view5[li].view(dtype) for li in range(layers)]


def block(views, b: int, r: int) -> list[torch.Tensor]:
    """Scheduler block ``b`` of every layer, by logical indexing (ground truth)."""
    return [v[b * r:(b + 1) * r].clone() for v in views]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which never equal themselves)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


CASES = [(lay, heads) for lay in LAYOUTS for heads in (1, 2, 4)]


@pytest.mark.parametrize("layout,heads", CASES)
@pytest.mark.parametrize("host", [True, False], ids=["memmove", "torch"])
def test_every_layout_round_trips_exactly_and_touches_no_other_block(layout, heads, host):
    buf, views = vllm_views(layout, layers=3, blocks=9, heads=heads, block_size=16, head_size=8)
    pl = detect(views, 9, expected=layout)
    pl.host = host  # the torch path is the device path, run here on CPU tensors
    assert pl.order == layout and pl.split == 1
    ids = [3, 1, 7]
    chunk = torch.empty(pl.chunk_shape(len(ids)), dtype=views[0].dtype)
    pl.gather(ids, chunk)
    want = [block(views, b, 1) for b in ids]
    before = buf.clone()
    dest = [5, 6, 0]
    pl.scatter(dest, chunk, first=1)  # block 5 is the engine's own: left alone
    for b_src, b_dst in zip(ids[1:], dest[1:]):
        for li, v in enumerate(views):
            assert same(v[b_dst], want[ids.index(b_src)][li][0])
    # Nothing outside blocks 6 and 0 changed.
    changed = (buf != before).nonzero().flatten()
    allowed = set()
    for b in dest[1:]:
        for v in views:
            page = v[b]
            base = (page.storage_offset()) * page.element_size()
            for idx in torch.cartesian_prod(*[torch.arange(s) for s in page.shape]).tolist():
                off = base + sum(i * s for i, s in zip(idx, page.stride())) * page.element_size()
                allowed.update(range(off, off + page.element_size()))
    assert set(changed.tolist()) <= allowed


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_a_kernel_split_block_is_found_and_round_trips(layout):
    """--block-size 32 over 16-token kernel blocks: the view counts 2 kernel
    blocks per scheduler block (FlashInfer or FlashMLA with a large block
    size on an H200)."""
    _, views = vllm_views(layout, layers=2, blocks=6, heads=2, block_size=32, head_size=8, kernel_block=16)
    assert views[0].shape[0] == 12
    pl = detect(views, 6, expected=layout)
    assert pl.split == 2 and pl.name == f"{layout}/r2"
    chunk = torch.empty(pl.chunk_shape(2), dtype=torch.float32)
    want = block(views, 4, 2)
    pl.gather([4, 2], chunk)
    pl.scatter([1, 3], chunk)
    got = block(views, 1, 2)
    assert all(same(a, b) for a, b in zip(got, want))


def test_the_gpu_default_layout_is_not_taken_for_the_cpu_one():
    """LBNHC (FlashAttention's default on 0.33) and LBHNC (CPU) hold a
    block's page in one run each but in another order: their names differ,
    and with several heads their chunk shapes differ too."""
    _, a = vllm_views("LBHNC", 2, 4, 2, 16, 8)
    _, b = vllm_views("LBNHC", 2, 4, 2, 16, 8)
    la, lb = detect(a, 4), detect(b, 4)
    assert (la.order, lb.order) == ("LBHNC", "LBNHC")
    assert la.describe() != lb.describe()
    assert " " not in la.describe()  # one token in log lines
    assert la.chunk_shape(1) != lb.chunk_shape(1)
    # Other head counts (other TP sizes of one model) keep one name.
    _, e = vllm_views("LBHNC", 2, 4, 4, 16, 8)
    assert detect(e, 4).describe() == la.describe() == "LBHNC/pageHNChx16x16"
    # One head: same bytes, different names all the same (never shared).
    _, c = vllm_views("LBHNC", 2, 4, 1, 16, 8)
    _, d = vllm_views("LBNHC", 2, 4, 1, 16, 8)
    assert detect(c, 4, "LBHNC").describe() != detect(d, 4, "LBNHC").describe()


def test_heads_lie_along_the_payload_axis_the_layout_names():
    for layout, axis in (("LBHNC", 2), ("LBNHC", 3), ("LHBNC", 2), ("BLNHC", 3)):
        _, views = vllm_views(layout, 2, 4, 4, 16, 8)
        pl = detect(views, 4, layout)
        assert pl.head_axis == axis
        assert pl.chunk_shape(1)[axis] == 4


def test_legacy_names_and_a_disagreeing_setting():
    _, views = vllm_views("LBNHC", 2, 4, 2, 16, 8)
    assert detect(views, 4, "NHD").order == "LBNHC"
    with pytest.raises(ConfigError, match="do not show layout LBHNC"):
        detect(views, 4, "LBHNC")
    with pytest.raises(ConfigError, match="does not know"):
        detect(views, 4, "XYZ")


def test_views_that_are_not_vllms_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="nor a multiple"):
        detect([torch.zeros(10, 2, 16, 16)], 4)
    with pytest.raises(ConfigError, match="uniform"):
        detect([torch.zeros(4, 2, 16, 16), torch.zeros(4, 1, 16, 16)], 4)
    with pytest.raises(ConfigError, match="unrecognised"):
        detect([torch.zeros(2, 4, 16, 2, 8)], 4)
