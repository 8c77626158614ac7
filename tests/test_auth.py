"""Cluster keys (kvtier/auth.py) and ``kvtier auth``: key files, their
modes, rotation, and the warning a shared tier without a key gives."""

from __future__ import annotations

import logging
import os

import pytest

from kvtier import auth
from kvtier.cli import main
from kvtier.codec import encode, seal, seal_problem
from kvtier.config import StoreConfig, TierSpec, load_config
from kvtier.engine.store import TieredStore
from kvtier.errors import ConfigError
from tests.support import DTYPE, keys_for, memory_config, payload_for, shape_for, shared_config


def _obj(seed: int = 1):
    k = keys_for(seed, 1)[0]
    return encode(k, DTYPE, shape_for(k.num_tokens), payload_for(k))


def test_a_seal_checks_out_only_under_its_key():
    a, b = auth.Keyring([auth.new_key()]), auth.Keyring([auth.new_key()])
    obj = _obj()
    assert seal_problem(obj, a) == auth.UNSEALED
    seal(obj, a)
    assert seal_problem(obj, a) is None
    assert seal_problem(obj, b) == auth.UNKNOWN_KEY
    tag = obj.header.tag
    seal(obj, b)  # sealed already: left as it is
    assert obj.header.tag == tag and seal_problem(obj, a) is None


def test_two_seals_of_the_same_bytes_differ():
    """A fresh nonce per object: no per-object key is ever used twice."""
    ring = auth.Keyring([auth.new_key()])
    x, y = _obj(), _obj()
    seal(x, ring)
    seal(y, ring)
    assert x.header.nonce != y.header.nonce and x.header.tag != y.header.tag


def test_key_ids_name_keys_without_revealing_them():
    k = auth.new_key()
    assert auth.key_id(k) == auth.key_id(k) and len(auth.key_id(k)) == 8
    assert auth.key_id(k) != auth.key_id(auth.new_key())
    assert k.hex()[:16] != auth.key_id(k).hex()


def test_keygen_writes_a_private_file_and_refuses_to_overwrite(tmp_path, capsys):
    path = str(tmp_path / "k")
    assert main(["auth", "keygen", path]) == 0
    assert os.stat(path).st_mode & 0o777 == 0o600
    kid = capsys.readouterr().out.split()[0]
    keys = auth.read_key_file(path)
    assert len(keys) == 1 and auth.key_id(keys[0]).hex() == kid
    assert kid in open(path).read() and keys[0].hex() in open(path).read()
    assert main(["auth", "keygen", path]) == 2
    assert "exists" in capsys.readouterr().err
    assert auth.read_key_file(path) == keys


def test_rotation_adds_promotes_and_removes(tmp_path, capsys):
    path = str(tmp_path / "k")
    assert main(["auth", "keygen", path]) == 0
    old = auth.read_key_file(path)[0]
    assert main(["auth", "add", path]) == 0
    keys = auth.read_key_file(path)
    assert keys[0] == old and len(keys) == 2  # the old key still seals
    new_id = auth.key_id(keys[1]).hex()
    assert main(["auth", "promote", path, new_id]) == 0
    assert auth.read_key_file(path) == [keys[1], old]
    assert main(["auth", "remove", path, auth.key_id(old).hex()]) == 0
    assert auth.read_key_file(path) == [keys[1]]
    assert main(["auth", "remove", path, new_id]) == 2  # never the last key
    assert main(["auth", "promote", path, "00" * 8]) == 2
    assert os.stat(path).st_mode & 0o777 == 0o600
    capsys.readouterr()


@pytest.mark.parametrize("mode,problem", [(0o644, "readable by every user"), (0o620, "writable by other users"),
                                          (0o602, "writable by other users")])
def test_a_key_file_other_users_can_read_or_write_is_refused(tmp_path, mode, problem):
    path = str(tmp_path / "k")
    auth.write_key_file(path, [auth.new_key()])
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=problem) as exc:
        auth.load_keyring(path)
    assert exc.value.key == "auth_key_file" and "chmod 600" in exc.value.fix
    os.chmod(path, 0o640)  # a group of readers is fine
    auth.load_keyring(path)


def test_a_key_file_of_another_user_is_refused(tmp_path):
    path = str(tmp_path / "k")
    auth.write_key_file(path, [auth.new_key()])
    os.chown(path, 65534, 65534)
    if os.geteuid() == 65534:  # pragma: no cover - the suite runs as root
        pytest.skip("runs as uid 65534")
    with pytest.raises(ConfigError, match="belongs to another user"):
        auth.load_keyring(path)


@pytest.mark.parametrize("text,problem", [
    ("", "holds no key"), ("# only a comment\n", "holds no key"), ("abcd\n", "line 1 is not a key"),
    ("zz" * 32 + "\n", "line 1 is not a key"), ("00" * 32 + "\n" + "11" * 31 + "\n", "line 2 is not a key"),
])
def test_a_malformed_key_file_names_the_line(tmp_path, text, problem):
    path = tmp_path / "k"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    with pytest.raises(ConfigError, match=problem):
        auth.load_keyring(str(path))


def test_a_missing_key_file_stops_the_store_with_the_fix(tmp_path):
    cfg = StoreConfig(tiers=(TierSpec("memory", memory_config(1 << 20)),), auth_key_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot open") as exc:
        TieredStore(cfg)
    assert "kvtier auth keygen" in exc.value.fix


def test_the_key_file_comes_from_the_environment(tmp_path):
    path = str(tmp_path / "k")
    auth.write_key_file(path, [auth.new_key()])
    cfg = load_config(environ={"KVTIER_TIERS": "memory://?capacity=1MiB", "KVTIER_AUTH_KEY_FILE": path})
    assert cfg.auth_key_file == path
    with TieredStore(cfg) as store:
        assert store.keyring is not None and store.keyring.write_id == auth.key_id(auth.read_key_file(path)[0])


def test_a_shared_tier_without_a_key_says_so_once(tmp_path, caplog):
    (tmp_path / "s").mkdir()
    cfg = StoreConfig(tiers=(TierSpec("memory", memory_config(1 << 20)),
                             TierSpec("shared", shared_config(tmp_path / "s", name="unkeyed-shared"))))
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.store"):
        TieredStore(cfg).close()
        TieredStore(cfg).close()
    said = [r.getMessage() for r in caplog.records if "no cluster key" in r.getMessage()]
    assert len(said) == 1
    assert "unkeyed-shared" in said[0] and "auth_key_file" in said[0] and "docs/security.md" in said[0]


def test_a_memory_tier_alone_gives_no_warning(caplog):
    cfg = StoreConfig(tiers=(TierSpec("memory", memory_config(1 << 20, name="private")),))
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.store"):
        TieredStore(cfg).close()
    assert not [r for r in caplog.records if "no cluster key" in r.getMessage()]
