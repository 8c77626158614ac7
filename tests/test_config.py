"""Configuration: every mistake is a ConfigError naming its key and the fix;
file < environment < overrides; YAML, TOML and JSON read alike."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtier.config import ConfigError, load_config, parse_size, parse_store_config, redact_url
from kvtier.engine.store import TieredStore
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.memory import MemoryConfig
from kvtier.tiers.shared import SharedConfig, SharedTier

GiB, MiB = 1 << 30, 1 << 20
MEM = {"kind": "memory", "capacity": "1GiB"}


def _error(values) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        parse_store_config(values)
    return exc.value


def _assert_names(err: ConfigError, key: str) -> None:
    assert err.key == key
    msg = str(err)
    assert f"'{key}'" in msg and "Fix:" in msg
    assert msg.split("Fix:", 1)[1].strip()  # the fix says something


BAD = {
    "unknown tier kind": ({"tiers": [{"kind": "floppy", "capacity": "1GiB"}]}, "tiers[0].kind"),
    "unknown tier kind in a URL": ({"tiers": ["floppy:///x?capacity=1GiB"]}, "tiers[0].kind"),
    "missing tier kind": ({"tiers": [{"capacity": "1GiB"}]}, "tiers[0].kind"),
    "unknown tier key": ({"tiers": [dict(MEM, colour="red")]}, "tiers[0].colour"),
    "unknown tier key in a URL": ({"tiers": ["memory://?capacity=1GiB&colour=red"]}, "tiers[0].colour"),
    "unknown store key": ({"tiers": [MEM], "chunk_size": 16}, "chunk_size"),
    "bad size string": ({"tiers": [{"kind": "memory", "capacity": "12 parsecs"}]}, "tiers[0].capacity"),
    "negative size": ({"tiers": [{"kind": "memory", "capacity": "-5GiB"}]}, "tiers[0].capacity"),
    "boolean size": ({"tiers": [{"kind": "memory", "capacity": True}]}, "tiers[0].capacity"),
    "bad store size": ({"tiers": [MEM], "save_queue_bytes": "lots"}, "save_queue_bytes"),
    "memory without capacity": ({"tiers": [{"kind": "memory"}]}, "tiers[0].capacity"),
    "disk without path": ({"tiers": [{"kind": "disk", "capacity": "1GiB"}]}, "tiers[0].path"),
    "disk without capacity": ({"tiers": [{"kind": "disk", "path": "/x"}]}, "tiers[0].capacity"),
    "zero io threads": ({"tiers": [{"kind": "disk", "path": "/x", "capacity": "1GiB", "io_threads": 0}]},
                        "tiers[0].io_threads"),
    "low above high watermark": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "low_watermark": 0.9, "high_watermark": 0.5}]},
        "tiers[0].low_watermark"),
    "high watermark above 1": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "high_watermark": 1.5}]},
        "tiers[0].low_watermark"),
    "zero low watermark": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "low_watermark": 0}]},
        "tiers[0].low_watermark"),
    "watermark not a number": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "high_watermark": "high"}]},
        "tiers[0].high_watermark"),
    "no tiers": ({"tiers": []}, "tiers"),
    "duplicate tier names": ({"tiers": [MEM, MEM]}, "tiers"),
    "chunk tokens zero": ({"tiers": [MEM], "chunk_tokens": 0}, "chunk_tokens"),
    "chunk tokens not an int": ({"tiers": [MEM], "chunk_tokens": "many"}, "chunk_tokens"),
    "bad boolean": ({"tiers": [MEM], "promote": "maybe"}, "promote"),
    "zero load timeout": ({"tiers": [MEM], "load_timeout_s": 0}, "load_timeout_s"),
    "not a tier URL": ({"tiers": ["memory"]}, "tiers[0]"),
    "URL option without value": ({"tiers": ["memory://?capacity"]}, "tiers[0]"),
    "memory takes no location": ({"tiers": ["memory:///somewhere?capacity=1GiB"]}, "tiers[0]"),
    "tier of the wrong type": ({"tiers": [42]}, "tiers[0]"),
    # Every numeric key has a range.
    "breaker threshold zero": ({"tiers": [MEM], "breaker_threshold": 0}, "breaker_threshold"),
    "negative breaker cooldown": ({"tiers": [MEM], "breaker_cooldown_s": -1}, "breaker_cooldown_s"),
    "NaN load timeout": ({"tiers": [MEM], "load_timeout_s": "nan"}, "load_timeout_s"),
    "infinite lookup timeout": ({"tiers": [MEM], "lookup_timeout_s": "inf"}, "lookup_timeout_s"),
    "zero temp-file age (would delete other nodes' writes)": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "tmp_max_age_s": 0}]}, "tiers[0].tmp_max_age_s"),
    "negative touch interval": (
        {"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "touch_interval_s": -1}]},
        "tiers[0].touch_interval_s"),
    "zero lease": ({"tiers": [{"kind": "shared", "path": "/x", "capacity": "1GiB", "lease_s": 0}]}, "tiers[0].lease_s"),
    "redis negative db": ({"tiers": [{"kind": "redis", "address": "h:1", "capacity": "1GiB", "db": -1}]}, "tiers[0].db"),
    "redis infinite timeout": ({"tiers": [{"kind": "redis", "address": "h:1", "capacity": "1GiB",
                                           "socket_timeout_s": "inf"}]}, "tiers[0].socket_timeout_s"),
    "s3 zero attempts": ({"tiers": [{"kind": "s3", "location": "bucket/p", "capacity": "1GiB", "max_attempts": 0}]},
                         "tiers[0].max_attempts"),
    "shm zero io threads": ({"tiers": [{"kind": "shm", "capacity": "1GiB", "io_threads": 0}]}, "tiers[0].io_threads"),
    # Sizes need their unit; values of the wrong type are refused, never coerced.
    "size without a unit": ({"tiers": [{"kind": "memory", "capacity": 20}]}, "tiers[0].capacity"),
    "size string without a unit": ({"tiers": [{"kind": "memory", "capacity": "20"}]}, "tiers[0].capacity"),
    "size in a URL without a unit": ({"tiers": ["memory://?capacity=20"]}, "tiers[0].capacity"),
    "infinite size": ({"tiers": [{"kind": "memory", "capacity": float("inf")}]}, "tiers[0].capacity"),
    "NaN size": ({"tiers": [{"kind": "memory", "capacity": float("nan")}]}, "tiers[0].capacity"),
    "size too large for a float": ({"tiers": [{"kind": "memory", "capacity": "9" * 400 + "GiB"}]}, "tiers[0].capacity"),
    "store size without a unit": ({"tiers": [MEM], "save_queue_bytes": 1048576}, "save_queue_bytes"),
    "tiers not a list": ({"tiers": 5}, "tiers"),
    "tiers a boolean": ({"tiers": True}, "tiers"),
    "chunk tokens a boolean": ({"tiers": [MEM], "chunk_tokens": True}, "chunk_tokens"),
    "chunk tokens a fraction": ({"tiers": [MEM], "chunk_tokens": 256.5}, "chunk_tokens"),
    "chunk tokens a list": ({"tiers": [MEM], "chunk_tokens": [256]}, "chunk_tokens"),
    "threshold a boolean": ({"tiers": [MEM], "breaker_threshold": True}, "breaker_threshold"),
    "timeout a boolean": ({"tiers": [MEM], "load_timeout_s": True}, "load_timeout_s"),
    "infinite timeout from YAML": ({"tiers": [MEM], "load_timeout_s": float("inf")}, "load_timeout_s"),
    "io threads a boolean": ({"tiers": [{"kind": "disk", "path": "/x", "capacity": "1GiB", "io_threads": True}]},
                             "tiers[0].io_threads"),
    "path null": ({"tiers": [{"kind": "disk", "path": None, "capacity": "1GiB"}]}, "tiers[0].path"),
    "path a list": ({"tiers": [{"kind": "shared", "path": ["/x"], "capacity": "1GiB"}]}, "tiers[0].path"),
    "name null": ({"tiers": [dict(MEM, name=None)]}, "tiers[0].name"),
    "node memory dir null": ({"tiers": [MEM], "node_memory_dir": None}, "node_memory_dir"),
    "tier name escaping its folder": ({"tiers": [dict(MEM, name="../x")]}, "tiers[0].name"),
    "tier name with a slash": ({"tiers": [dict(MEM, name="a/b")]}, "tiers[0].name"),
    "hidden tier name": ({"tiers": [dict(MEM, name=".x")]}, "tiers[0].name"),
    "tier name in a URL escaping its folder": ({"tiers": ["memory://?capacity=1GiB&name=.."]}, "tiers[0].name"),
    "empty tier name": ({"tiers": [dict(MEM, name="")]}, "tiers[0].name"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_values_name_the_key_and_the_fix(name):
    values, key = BAD[name]
    _assert_names(_error(values), key)


def test_unknown_kind_lists_the_known_kinds():
    msg = str(_error(BAD["unknown tier kind"][0]))
    assert all(kind in msg for kind in ("memory", "disk", "shared"))


def test_unknown_key_lists_the_known_keys():
    assert "capacity" in str(_error(BAD["unknown tier key"][0]))
    assert "chunk_tokens" in str(_error(BAD["unknown store key"][0]))


def test_config_error_is_a_value_error():
    assert isinstance(_error(BAD["no tiers"][0]), ValueError)


@pytest.mark.parametrize("tier_cls,cfg_cls", [(DiskTier, DiskConfig), (SharedTier, SharedConfig)])
def test_an_unusable_directory_names_the_path_key(tmp_path, tier_cls, cfg_cls):
    # Tests run as root, so permissions do not stop them: a path below a
    # regular file can never be a directory.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as exc:
        tier_cls(cfg_cls(path=str(blocker / "sub"), capacity=GiB))
    assert exc.value.key == f"{cfg_cls().name}.path"
    assert "Fix:" in str(exc.value) and str(blocker / "sub") in str(exc.value)


def test_an_unusable_directory_fails_the_store_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = parse_store_config({"tiers": [MEM, {"kind": "disk", "path": str(blocker / "sub"), "capacity": "1GiB"}]})
    with pytest.raises(ConfigError) as exc:
        TieredStore(cfg)
    assert "path" in exc.value.key and "Fix:" in str(exc.value)


def test_capacity_smaller_than_one_chunk(tmp_path):
    cfg = parse_store_config({"tiers": [
        {"kind": "memory", "capacity": "1MiB"},
        {"kind": "disk", "path": str(tmp_path / "d"), "capacity": "64KiB"},
    ]})
    with pytest.raises(ConfigError) as exc:
        TieredStore(cfg, chunk_bytes=128 << 10)
    _assert_names(exc.value, "tiers[1].capacity")
    DiskTier(DiskConfig(path=str(tmp_path / "d"), capacity=GiB)).close()  # nothing left holding it
    TieredStore(cfg, chunk_bytes=64 << 10).close()  # exactly one chunk fits: allowed


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "text,expect",
    [("4096B", 4096), ("4096 b", 4096), ("1k", 1024), ("1Ki", 1024), ("1KiB", 1024), ("1.5KiB", 1536), ("512MiB", 512 * MiB),
     ("8G", 8 * GiB), ("8 GiB", 8 * GiB), ("10GB", 10 * 10**9), ("1MB", 10**6), ("2TiB", 2 << 40),
     ("1tb", 10**12), (" 3 m ", 3 * MiB), (0, 0), ("0", 0)],
)
def test_sizes(text, expect):
    assert parse_size(text, "k") == expect


@pytest.mark.parametrize("text", ["", "GiB", "1.2.3G", "1XB", "-1G", "ten", None, False, True, 4096, "4096", 1.5,
                                  float("inf"), float("-inf"), float("nan"), "inf", pytest.param(10**400, id="10**400"),
                                  pytest.param("1" * 400 + "TiB", id="1e400TiB"),
                                  [1], {"a": 1}, "20i"])
def test_bad_sizes(text):
    with pytest.raises(ConfigError) as exc:
        parse_size(text, "some.key")
    assert exc.value.key == "some.key" and "Fix:" in str(exc.value)


# ---------------------------------------------------------------- tiers and types


def test_a_size_without_its_unit_names_the_fix_with_the_number():
    with pytest.raises(ConfigError) as exc:
        parse_size(20, "tiers[0].capacity")
    assert "no unit" in exc.value.problem and "20GiB" in exc.value.fix and "20B" in exc.value.fix


def test_what_is_left_is_read_exactly():
    cfg = parse_store_config({"tiers": [dict(MEM, name="mem-0.fast_1")], "chunk_tokens": 256.0,
                              "load_timeout_s": 3, "node_memory_dir": "/dev/shm/x"})
    assert cfg.chunk_tokens == 256 and cfg.load_timeout_s == 3.0 and cfg.tiers[0].config.name == "mem-0.fast_1"
    # YAML reads an unquoted 0123 as 83: a number is never taken for a string.
    with pytest.raises(ConfigError) as exc:
        parse_store_config({"tiers": [{"kind": "redis", "address": "h:1", "capacity": "1GiB", "password": 83}]})
    assert exc.value.key == "tiers[0].password" and "quotes" in exc.value.fix and "83" not in exc.value.problem


def test_tier_urls_and_mappings_are_equivalent():
    a = parse_store_config({"tiers": ["disk:///nvme/kv?capacity=500GiB&io_threads=8&o_direct=false"]})
    b = parse_store_config({"tiers": [{"kind": "disk", "path": "/nvme/kv", "capacity": "500GiB", "io-threads": 8,
                                       "o_direct": False}]})
    assert a == b
    (spec,) = a.tiers
    assert spec.kind == "disk"
    assert spec.config == DiskConfig(path="/nvme/kv", capacity=500 * GiB, io_threads=8, o_direct=False)


def test_file_and_dir_are_aliases_of_shared():
    cfg = parse_store_config({"tiers": ["file:///mnt/kv?capacity=1TiB"]})
    assert cfg.tiers[0].kind == "shared"
    assert cfg.tiers[0].config == SharedConfig(path="/mnt/kv", capacity=1 << 40)


def test_config_is_typed_and_frozen():
    cfg = parse_store_config({"tiers": [MEM], "chunk_tokens": "128", "promote": "off", "load_timeout_s": "2.5"})
    assert (cfg.chunk_tokens, cfg.promote, cfg.load_timeout_s) == (128, False, 2.5)
    assert cfg.tiers[0].config == MemoryConfig(capacity=GiB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_tokens = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tiers[0].config.capacity = 1


def test_one_tier_may_be_given_without_a_list():
    assert parse_store_config({"tiers": "memory://?capacity=1GiB"}).tiers[0].config.capacity == GiB


# ---------------------------------------------------------------- files and precedence

FILE_VALUES = {"chunk_tokens": 64, "save_queue_bytes": "1MiB", "promote": False,
               "tiers": [{"kind": "memory", "capacity": "1GiB"}, {"kind": "shared", "path": "/mnt/kv", "capacity": "2GiB",
                                                                  "high_watermark": 0.9, "low_watermark": 0.8}]}
YAML = """\
chunk_tokens: 64
save_queue_bytes: 1MiB
promote: false
tiers:
  - {kind: memory, capacity: 1GiB}
  - kind: shared
    path: /mnt/kv
    capacity: 2GiB
    high_watermark: 0.9
    low_watermark: 0.8
"""
TOML = """\
chunk_tokens = 64
save_queue_bytes = "1MiB"
promote = false

[[tiers]]
kind = "memory"
capacity = "1GiB"

[[tiers]]
kind = "shared"
path = "/mnt/kv"
capacity = "2GiB"
high_watermark = 0.9
low_watermark = 0.8
"""


@pytest.fixture(params=["yaml", "yml", "toml", "json"])
def config_file(request, tmp_path):
    text = {"yaml": YAML, "yml": YAML, "toml": TOML, "json": json.dumps(FILE_VALUES)}[request.param]
    path = tmp_path / f"kvtier.{request.param}"
    path.write_text(text)
    return path


def test_yaml_toml_and_json_files_read_alike(config_file):
    cfg = load_config(config_file, environ={})
    assert cfg == parse_store_config(FILE_VALUES)
    assert cfg.chunk_tokens == 64 and cfg.save_queue_bytes == MiB and cfg.promote is False
    assert cfg.tiers[1].config.capacity == 2 * GiB and cfg.tiers[1].config.low_watermark == 0.8


def test_precedence_is_file_then_environment_then_overrides(config_file, monkeypatch):
    env = {"KVTIER_CHUNK_TOKENS": "128", "KVTIER_TIERS": "memory://?capacity=3GiB,disk:///nvme/kv?capacity=4GiB"}
    monkeypatch.setenv("KVTIER_CHUNK_TOKENS", "999")  # ignored: environ is given explicitly

    assert load_config(config_file, environ={}).chunk_tokens == 64
    cfg = load_config(config_file, environ=env)
    assert cfg.chunk_tokens == 128
    assert [t.kind for t in cfg.tiers] == ["memory", "disk"]  # the environment's tiers replace the file's
    assert cfg.tiers[0].config.capacity == 3 * GiB
    assert cfg.save_queue_bytes == MiB  # not in the environment: the file's value stands
    cfg = load_config(config_file, overrides={"chunk_tokens": 512, "promote": True}, environ=env)
    assert (cfg.chunk_tokens, cfg.promote) == (512, True)


def test_the_config_file_may_come_from_the_environment(config_file):
    cfg = load_config(environ={"KVTIER_CONFIG": str(config_file), "KVTIER_PROMOTE": "yes"})
    assert cfg.chunk_tokens == 64 and cfg.promote is True


def test_environment_values_are_checked_like_any_other():
    with pytest.raises(ConfigError) as exc:
        load_config(environ={"KVTIER_TIERS": "memory://?capacity=1GiB", "KVTIER_SAVE_QUEUE_BYTES": "a lot"})
    _assert_names(exc.value, "save_queue_bytes")


@pytest.mark.parametrize(
    "name,text",
    [("bad.yaml", "tiers: [unclosed"), ("bad.toml", "tiers = [[["), ("bad.json", "{nope"), ("list.json", "[1, 2]")],
)
def test_unreadable_config_files_name_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, environ={})
    assert exc.value.key == "config" and name in str(exc.value) and "Fix:" in str(exc.value)


def test_a_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "absent.yaml", environ={})
    assert exc.value.key == "config" and "absent.yaml" in str(exc.value)


def test_a_redis_node_list_in_kvtier_tiers_stays_one_tier():
    cfg = load_config(environ={"KVTIER_TIERS": "memory://?capacity=1GiB,redis://10.0.0.1:6379,10.0.0.2:6379,"
                                                 "10.0.0.3:6379?capacity=8GiB&cluster=true,shared:///mnt/kv?capacity=1TiB"})
    assert [t.kind for t in cfg.tiers] == ["memory", "redis", "shared"]
    redis = cfg.tiers[1].config
    assert redis.nodes() == [("10.0.0.1", 6379), ("10.0.0.2", 6379), ("10.0.0.3", 6379)] and redis.cluster


def test_tier_secrets_come_from_the_environment_and_never_show(caplog):
    env = {"KVTIER_TIERS": "redis://127.0.0.1:6379?capacity=1GiB,redis://127.0.0.1:6380?capacity=1GiB&name=other",
           "KVTIER_REDIS_PASSWORD": "s3cr3t-all", "KVTIER_REDIS_PASSWORD_OTHER": "s3cr3t-other",
           "KVTIER_REDIS_USERNAME": "kv"}
    cfg = load_config(environ=env)
    first, other = (t.config for t in cfg.tiers)
    assert (first.password, first.username) == ("s3cr3t-all", "kv")
    assert other.password == "s3cr3t-other"  # the tier's own variable first
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in str(cfg)
    from kvtier.tiers.redis.tier import RedisTier

    tier = RedisTier(first)
    try:
        kwargs = tier._connect().connection_pool.connection_kwargs  # what the client will send
        assert kwargs["password"] == "s3cr3t-all" and kwargs["username"] == "kv"
        assert "s3cr3t" not in repr(tier)
    finally:
        tier.close()
    assert "s3cr3t" not in caplog.text
    # A value in the config itself wins over the environment.
    own = parse_store_config({"tiers": [{"kind": "redis", "address": "127.0.0.1:6379", "capacity": "1GiB",
                                         "password": "inline"}]}, env)
    assert own.tiers[0].config.password == "inline"


SECRET = "Zx9-never-shown"


@pytest.mark.parametrize("url, key, fix", [
    (f"redis://127.0.0.1:6379?capacity=1GiB&password={SECRET}", "password", "KVTIER_REDIS_PASSWORD"),
    (f"rediss://127.0.0.1:6379?password={SECRET}&capacity=1GiB", "password", "KVTIER_REDIS_PASSWORD"),
    (f"redis://127.0.0.1:6379?capacity=1GiB&username={SECRET}", "username", "KVTIER_REDIS_USERNAME"),
    (f"redis://kv:{SECRET}@127.0.0.1:6379?capacity=1GiB", "address", "KVTIER_REDIS_PASSWORD"),
    (f"s3://bucket/p?capacity=1GiB&access_key_id=AKID&secret_access_key={SECRET}", "access_key_id", "KVTIER_S3_ACCESS_KEY_ID"),
    (f"s3://bucket/p?capacity=1GiB&secret_access_key={SECRET}", "secret_access_key", "KVTIER_S3_SECRET_ACCESS_KEY"),
    (f"s3://bucket/p?capacity=1GiB&endpoint=http://AKID:{SECRET}@127.0.0.1:8333", "endpoint", "KVTIER_S3_SECRET_ACCESS_KEY"),
    (f"redis://127.0.0.1:6379?capacity=1GiB&password={SECRET}&oops", "", ""),  # another error: still not shown
])
def test_credentials_in_a_tier_url_are_refused_and_never_repeated(url, key, fix):
    with pytest.raises(ConfigError) as err:
        load_config(environ={"KVTIER_TIERS": f"memory://?capacity=1GiB,{url}"})
    text = str(err.value)
    assert SECRET not in text
    assert (f"tiers[1].{key}" if key else "tiers[1]") in text and fix in text


def test_secrets_given_the_documented_ways_are_taken():
    env = {"KVTIER_TIERS": "s3://bucket/p?capacity=1GiB&endpoint=http://127.0.0.1:8333",
           "KVTIER_S3_ACCESS_KEY_ID": "AKID", "KVTIER_S3_SECRET_ACCESS_KEY": SECRET}
    s3 = load_config(environ=env).tiers[0].config
    assert (s3.access_key_id, s3.secret_access_key) == ("AKID", SECRET)
    assert SECRET not in repr(s3) and "AKID" not in repr(s3)


def test_redact_url_blanks_every_credential():
    shown = redact_url(f"s3://b/p?endpoint=http://AKID:{SECRET}@h:1&secret_access_key={SECRET}&capacity=1GiB")
    assert shown == "s3://b/p?endpoint=http://***@h:1&secret_access_key=***&capacity=1GiB"
    assert redact_url(f"redis://kv:{SECRET}@h:6379?password={SECRET}") == "redis://***@h:6379?password=***"


def test_a_misspelled_variable_is_warned_about_with_the_closest_name(caplog):
    import logging

    from kvtier import config as config_mod

    config_mod._warned.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        load_config(environ={"KVTIER_TIERS": "memory://?capacity=1GiB", "KVTIER_CHUNK_TOKEN": "512",
                             "KVTIER_TEST_ENGINES": "1", "KVTIER_REDIS_PASSWORD_X": "p"})
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["KVTIER_CHUNK_TOKEN is not a kvtier setting and is ignored; did you mean KVTIER_CHUNK_TOKENS?"]
