"""The connector's own keys (settings.py): where they are read from, and
that a bad one names the key and the fix."""

from __future__ import annotations

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.settings import connector_section, parse_connector_keys, parse_load_decision


@pytest.mark.parametrize("extra, key", [
    ({"load_decision": "sometimes"}, "load_decision"),
    ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s"),
    ({"prefill_tokens_per_s": "nan"}, "prefill_tokens_per_s"),
    ({"probe_interval_s": -1}, "probe_interval_s"),
    ({"read_rates": {"nosuch": "1GB"}}, "read_rates.nosuch"),
    ({"read_rates": {"shared": "fast"}}, "read_rates.shared"),
    ({"read_rates": ["shared"]}, "read_rates"),
    ({"read_rates": {"shared": 2000000000}}, "read_rates.shared"),  # a rate needs its unit, as a size does
    ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s"),
    ({"probe_interval_s": True}, "probe_interval_s"),
])
def test_bad_decision_settings_name_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        parse_load_decision(dict(extra), ["memory", "shared"])
    assert err.value.key == key


def test_connector_keys_come_from_the_config_files_vllm_section(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers: [{kind: shared, path: %s, capacity: 1GiB}]\n"
                    "vllm: {load_decision: always, read_rates: {shared: 2GB}, io_cpus: '0'}\n" % (tmp_path / "s"))
    cfg = load_config(path, environ={})  # the store's keys: the section is not one of them
    keys = parse_connector_keys(connector_section(str(path), {}), [t.config.name for t in cfg.tiers])
    assert keys.decision.mode == "always" and keys.decision.read_rates == (("shared", 2e9),)
    assert keys.io_cpus == {0}
    with pytest.raises(ConfigError) as err:
        parse_connector_keys({"load_decison": "auto"}, ["shared"])
    assert err.value.key == "vllm.load_decison" and "load_decision" in err.value.fix
    with pytest.raises(ConfigError) as err:
        parse_connector_keys({"model_fingerprint": True}, ["shared"])  # not the string "True"
    assert err.value.key == "vllm.model_fingerprint"


def test_spin_during_loads_is_a_connector_key():
    assert parse_connector_keys({}, ["shared"]).spin_during_loads is False  # the default: no spin while loading
    assert parse_connector_keys({"spin_during_loads": "true"}, ["shared"]).spin_during_loads is True
    with pytest.raises(ConfigError) as err:
        parse_connector_keys({"spin_during_loads": "sometimes"}, ["shared"])
    assert err.value.key == "vllm.spin_during_loads" and "true or false" in err.value.fix


@pytest.mark.parametrize("value", [0, 65, "4", 2.5, True])
def test_load_threads_is_a_whole_number_of_loads_read_at_once(value):
    assert parse_connector_keys({}, ["shared"]).load_threads == 1
    assert parse_connector_keys({"load_threads": 8}, ["shared"]).load_threads == 8
    with pytest.raises(ConfigError) as err:
        parse_connector_keys({"load_threads": value}, ["shared"])
    assert err.value.key == "vllm.load_threads"


def test_a_memory_tier_under_vllm_becomes_the_nodes_memory_and_refuses_lfu(tmp_path):
    from kvtier.config import parse_store_config
    from kvtier.integrations.vllm.topology import node_memory

    def store(eviction):
        return parse_store_config({"node_memory_dir": str(tmp_path), "tiers": [
            {"kind": "memory", "capacity": "64MiB", "eviction": eviction}]})

    shm = node_memory(store("lru")).tiers[0]
    assert shm.kind == "shm" and shm.config.capacity == 64 << 20
    with pytest.raises(ConfigError) as err:
        node_memory(store("lfu"))
    assert err.value.key == "tiers[0].eviction" and "lru" in err.value.fix
