"""The tier contract as ``tiers/base.py`` declares it: every method the store
calls on a tier is declared on ``Tier``; optional maintenance is one protocol,
told by ``isinstance``, never by probing names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier.engine.store as store_mod
from kvtier.config import parse_store_config
from kvtier.engine.store import TieredStore
from kvtier.metrics import Metrics
from kvtier.tiers.base import FetchInto, Maintenance, Tier
from kvtier.tiers.memory import MemoryConfig, MemoryTier
from tests.support import make_chunks

# What TieredStore calls on a tier (checked against its source below).
CONTRACT = ("lookup", "fetch", "done_with", "load", "store", "store_async", "delete", "stats", "close")
# What it calls only on tiers that have an optional ability, by its protocol.
OPTIONAL = {"fetch_into": FetchInto}


def test_the_base_declares_every_method_the_store_calls_on_a_tier():
    tree = ast.parse(Path(store_mod.__file__).read_text())
    called = {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name) and n.func.value.id in ("tier", "t")
    }
    called |= {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "memory"
    }
    assert called, "found no call on a tier: the check lost its way"
    assert called <= set(CONTRACT) | set(OPTIONAL), called - set(CONTRACT) - set(OPTIONAL)
    for name in CONTRACT:
        assert callable(getattr(Tier, name, None)), name
    for name, protocol in OPTIONAL.items():
        assert callable(getattr(protocol, name, None)) and not hasattr(Tier, name), name


def test_fetch_into_is_a_protocol_the_pooled_tiers_have(tmp_path):
    from kvtier.tiers.shared import SharedTier
    from tests.support import shared_config

    mem = MemoryTier(MemoryConfig(name="memory", capacity=1 << 20))
    shared = SharedTier(shared_config(tmp_path / "shared", 1 << 20))
    try:
        assert not isinstance(mem, FetchInto)
        assert isinstance(shared, FetchInto)
    finally:
        mem.close()
        shared.close()


def test_maintenance_is_a_protocol(tmp_path):
    mem = MemoryTier(MemoryConfig(name="memory", capacity=1 << 20))
    try:
        assert isinstance(mem, Maintenance)
        c = make_chunks(2)
        mem.store(c.objs)
        assert mem.drop_cache() == 0
        assert mem.clear() == 2
    finally:
        mem.close()


def test_a_tier_without_a_pool_stores_in_the_background_by_its_default():
    cfg = parse_store_config({"tiers": [{"kind": "memory", "capacity": "1MiB"}]})
    with TieredStore(cfg, Metrics()) as store:
        tier = store.tier("memory")
        c = make_chunks(2)
        fut = Tier.store_async(tier, c.objs)
        assert fut.done() and fut.result() == 2
