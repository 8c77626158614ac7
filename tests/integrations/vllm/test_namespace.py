"""The namespace from vLLM's configuration (namespace.py); the weights'
identity it reads is tested in test_identity.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvtier.config import parse_store_config
from kvtier.integrations.vllm.namespace import layout_name
from kvtier.integrations.vllm.settings import Settings
from kvtier.integrations.vllm.topology import Topology
from kvtier.keys import Namespace


def test_the_layout_and_the_workers_pages_are_in_the_namespace():
    """Two engines whose pages differ (resolved layout, backend, kernel
    split) never derive the same keys."""
    spec = SimpleNamespace(dtype=torch.float32, block_size=16, head_size=8)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))
    names = {layout_name(cfg, spec, lay) for lay in ("LBHNC", "LBNHC", None)}
    assert len(names) == 3 and any(n.endswith("/LBNHC") for n in names)

    ns = Namespace("m", "f", "float32", "x", 2, 2, 8, 16)
    base = Settings(parse_store_config({"tiers": [{"kind": "memory", "capacity": "1MiB"}], "chunk_tokens": 16}),
                    ns, 16, 2, "float32", Topology(1, None), "LBNHC", awaiting_page=True)
    pages = ("FLASH_ATTN/LBNHC/pageNHC16xhx16", "FLASHINFER/LBNHC/pageNHC16xhx16",
             "FLASH_ATTN/LBNHC/r2/pageRNHC2x8xhx16")
    digests = {base.with_page(p).namespace.digest() for p in pages}
    assert len(digests) == 3
    assert not base.with_page(pages[0]).awaiting_page
