"""Eviction policies by name: the built-ins, a policy class by import path,
and the checks a tier's config makes (``check``)."""

from __future__ import annotations

import textwrap

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.eviction import BUILTIN, check, make, policy_class
from kvtier.tiers.eviction.base import EvictionPolicy
from kvtier.tiers.eviction.lfu import LFUPolicy
from kvtier.tiers.eviction.lru import LRUPolicy
from kvtier.tiers.eviction.watermark import WatermarkPolicy


class _Config:
    capacity = 1000


class _Watermarks(_Config):
    high_watermark = 0.9
    low_watermark = 0.5


class _Stamped(_Watermarks):
    stamped_recency = True


def test_built_in_names_resolve_and_make_empty_policies_under_a_config():
    assert policy_class("lru") is LRUPolicy and policy_class("watermark") is WatermarkPolicy
    assert policy_class("lfu") is LFUPolicy
    p = make("lru", _Config())
    assert (type(p), p.capacity, len(p)) == (LRUPolicy, 1000, 0)
    w = make("watermark", _Watermarks())
    assert (w.capacity, w.high_watermark, w.low_watermark) == (1000, 0.9, 0.5)
    assert all(BUILTIN[n].name == n for n in BUILTIN)


def test_a_config_without_a_high_watermark_evicts_when_a_store_does_not_fit():
    class Low(_Config):
        low_watermark = 0.8

    w = make("watermark", Low())
    assert w.high_watermark == 1.0
    assert w.to_free(990, 10) == 0 and w.to_free(990, 11) == 190


def test_an_unknown_name_is_refused_naming_the_key_and_the_known_names():
    with pytest.raises(ConfigError) as e:
        check("lruu", _Config(), "tiers[0].eviction")
    assert e.value.key == "tiers[0].eviction"
    assert "lruu" in e.value.problem
    assert all(n in e.value.fix for n in BUILTIN) and "package.module:Class" in e.value.fix


def test_a_policy_that_needs_watermarks_is_refused_where_the_config_has_none():
    with pytest.raises(ConfigError) as e:
        check("watermark", _Config(), "eviction")
    assert "low_watermark" in e.value.problem
    assert e.value.fix == "use one of: lru, lfu"
    check("watermark", _Watermarks(), "eviction")  # the config has them: fine
    check("watermark", _Watermarks, "eviction")  # a config class answers alike (the planner checks so)


_PLUGIN = '''
from kvtier.tiers.eviction.base import EvictionPolicy
from kvtier.tiers.eviction.lfu import LFUPolicy


class NewestFirst(EvictionPolicy):
    """Most recently inserted first (keeps nothing of recency: a test's policy)."""
    name = "newest"

    def __iter__(self):
        return reversed(list(self._held))


NOT_A_POLICY = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "evict_plugin.py").write_text(textwrap.dedent(_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "evict_plugin"


def test_a_policy_class_by_import_path_runs_as_a_built_in_does(plugin):
    cls = policy_class(f"{plugin}:NewestFirst")
    assert issubclass(cls, EvictionPolicy)
    p = make(f"{plugin}:NewestFirst", _Config())
    for k in "abc":
        p.insert(k, 10)
    assert p.victims(15) == ["c", "b"]
    check(f"{plugin}:NewestFirst", _Config(), "eviction")


def test_a_shared_tier_refuses_a_policy_a_scan_of_stamps_cannot_rebuild(plugin):
    check("lru", _Stamped(), "eviction")
    check("watermark", _Stamped(), "eviction")
    with pytest.raises(ConfigError) as e:
        check("lfu", _Stamped(), "eviction")
    assert "recency stamp" in e.value.problem and e.value.fix == "use one of: lru, watermark"
    with pytest.raises(ConfigError) as e:
        check(f"{plugin}:NewestFirst", _Stamped(), "tiers[1].eviction")
    assert e.value.key == "tiers[1].eviction"
    assert "recency stamp" in e.value.problem
    assert e.value.fix == "use one of: lru, watermark"


@pytest.mark.parametrize("path, said", [
    ("evict_plugin:NOT_A_POLICY", "not an eviction policy class"),
    ("evict_plugin:Missing", "cannot load"),
    ("no_such_module_kvtier:X", "cannot load"),
])
def test_an_import_path_that_names_no_policy_class_is_refused(plugin, path, said):
    with pytest.raises(ConfigError) as e:
        policy_class(path, "eviction")
    assert e.value.key == "eviction" and said in e.value.problem
