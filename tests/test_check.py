"""`kvtier check` against real things: folders of this and another user, a
real redis-server (and a dead port), a real S3 gateway, real key files.

Each test runs the command in this process (``kvtier.cli.main``) with the
KVTIER_* variables of the test run removed; the rows are read from the JSON
output, and the table is checked where its text matters (secrets)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from kvtier import auth
from kvtier.check.node import vllm_release
from kvtier.check.report import Report
from kvtier.cli import main
from tests.tiers.redisserver import RedisServer, free_port

NOBODY = 65534


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("KVTIER_") or var.startswith("AWS_"):
            monkeypatch.delenv(var)


@pytest.fixture
def shm_dir():
    """A folder on tmpfs: a mount of its own, as a shared mount or the node memory is."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-check-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_config(path: Path, values: dict, mode: int = 0o600) -> Path:
    path.write_text(yaml.safe_dump(values))
    path.chmod(mode)
    return path


def check(*args: str, capsys) -> tuple[int, dict[str, list[dict]], str]:
    """Exit status, rows by check name, and the table's text of one run."""
    status = main(["check", *args])
    table = capsys.readouterr().out
    assert main(["check", "--json", *args]) == status
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_status"] == status
    rows: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        rows.setdefault(r["check"], []).append(r)
    return status, rows, table


def status_of(rows, name: str) -> str:
    assert name in rows, f"no row {name}: {sorted(rows)}"
    return ",".join(r["status"] for r in rows[name])


def local_config(tmp_path: Path, shm_dir: Path, **extra) -> dict:
    (tmp_path / "disk").mkdir(mode=0o700)
    (shm_dir / "shared").mkdir()
    return {"node_memory_dir": str(shm_dir / "node"),
            "tiers": [{"kind": "memory", "capacity": "64MiB"},
                      {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"},
                      {"kind": "shared", "path": str(shm_dir / "shared"), "capacity": "64MiB"}], **extra}


def test_help_explains_checks_and_exit_status():
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "check", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for words in ("--kv-transfer-config", "--expect-key-id", "exit status", "a check FAILed",
                  "could not be read", "never printed"):
        assert words in out.stdout
    top = subprocess.run([sys.executable, "-m", "kvtier.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert "check" in top.stdout


def test_local_tiers_ok_and_nothing_created(tmp_path, shm_dir, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", local_config(tmp_path, shm_dir))
    before = sorted(p for p in list(tmp_path.rglob("*")) + list(shm_dir.rglob("*")))
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    for name in ("config", "config file", "tiers[memory] folder", "tiers[memory] tmpfs", "tiers[memory] space",
                 "tiers[disk] folder", "tiers[disk] space", "tiers[shared] folder", "tiers[shared] mount",
                 "tiers[shared] format", "tiers[shared] space", "vllm", "chunk size"):
        assert status_of(rows, name) == "OK", rows[name]
    assert "does not exist yet" in rows["tiers[memory] folder"][0]["detail"]
    assert "tmpfs" in rows["tiers[shared] mount"][0]["detail"]
    # A shared tier without a cluster key: a warning, not a failure.
    assert status_of(rows, "auth key") == "WARN" and "kvtier auth keygen" in rows["auth key"][0]["fix"]
    assert status == 0
    assert main(["check", "--config", str(cfg), "--strict"]) == 1
    capsys.readouterr()
    assert sorted(p for p in list(tmp_path.rglob("*")) + list(shm_dir.rglob("*"))) == before


def test_foreign_owned_or_world_writable_folders_fail(tmp_path, shm_dir, capsys):
    foreign, open_, node = tmp_path / "foreign", tmp_path / "open", shm_dir / "node"
    for d in (foreign, open_, node):
        d.mkdir(mode=0o700)
    os.chown(foreign, NOBODY, NOBODY)
    open_.chmod(0o777)
    os.chown(node, NOBODY, NOBODY)  # another user took the node memory folder first
    cfg = write_config(tmp_path / "kvtier.yaml", {
        "node_memory_dir": str(node),
        "tiers": [{"kind": "memory", "capacity": "64MiB"},
                  {"kind": "disk", "name": "a", "path": str(foreign), "capacity": "1GiB"},
                  {"kind": "disk", "name": "b", "path": str(open_), "capacity": "1GiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status == 1
    assert status_of(rows, "tiers[a] folder") == "FAIL" and f"uid {NOBODY}" in rows["tiers[a] folder"][0]["detail"]
    assert status_of(rows, "tiers[b] folder") == "FAIL" and "0777" in rows["tiers[b] folder"][0]["detail"]
    assert status_of(rows, "tiers[memory] folder") == "FAIL"
    assert "chmod 700" in rows["tiers[b] folder"][0]["fix"]


def test_shared_root_missing_fails_and_on_root_fs_warns(tmp_path, capsys):
    (tmp_path / "on-root").mkdir()
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [
        {"kind": "shared", "name": "gone", "path": str(tmp_path / "missing"), "capacity": "1GiB"},
        {"kind": "shared", "name": "local", "path": str(tmp_path / "on-root"), "capacity": "1GiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status == 1
    assert status_of(rows, "tiers[gone] folder") == "FAIL" and "mount" in rows["tiers[gone] folder"][0]["fix"]
    assert not (tmp_path / "missing").exists()
    assert status_of(rows, "tiers[local] folder") == "OK"
    assert status_of(rows, "tiers[local] mount") == "WARN"
    assert "root file system" in rows["tiers[local] mount"][0]["detail"]


def test_shared_store_of_another_uid_fails(shm_dir, tmp_path, capsys):
    store = shm_dir / "kvtier-v1"
    store.mkdir(mode=0o700)
    os.chown(store, NOBODY, NOBODY)
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [{"kind": "shared", "path": str(shm_dir), "capacity": "1MiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status == 1 and status_of(rows, "tiers[shared] folder") == "FAIL"
    assert f"run kvtier as uid {NOBODY}" in rows["tiers[shared] folder"][0]["fix"]


def test_free_space_below_capacity_warns(tmp_path, capsys):
    (tmp_path / "disk").mkdir(mode=0o700)
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "capacity": "1PiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status == 0 and status_of(rows, "tiers[disk] space") == "WARN"
    assert "more than the whole file system" in rows["tiers[disk] space"][0]["detail"]


def test_redis_reachable_with_its_password_never_shown(tmp_path, monkeypatch, capsys):
    password = "pw-never-shown-7f3a"
    srv = RedisServer(tmp_path / "redis", password=password)
    try:
        cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [
            {"kind": "redis", "name": "env", "address": srv.address, "capacity": "1GiB"},
            {"kind": "redis", "name": "wrong", "address": srv.address, "capacity": "1GiB", "password": "wrong-pw-91"},
            {"kind": "redis", "name": "dead", "address": f"127.0.0.1:{free_port()}", "capacity": "1GiB",
             "password": "dead-pw-55"},
            {"kind": "redis", "name": "deadcluster", "address": f"127.0.0.1:{free_port()}", "cluster": True,
             "capacity": "1GiB"}]})
        monkeypatch.setenv("KVTIER_REDIS_PASSWORD_ENV", password)
        status, rows, table = check("--config", str(cfg), capsys=capsys)
        json_out = main(["check", "--json", "--config", str(cfg)]), capsys.readouterr().out
    finally:
        srv.stop()
    assert status_of(rows, "tiers[env] reach") == "OK" and "PING" in rows["tiers[env] reach"][0]["detail"]
    assert status_of(rows, "tiers[wrong] reach") == "FAIL" and "refused" in rows["tiers[wrong] reach"][0]["detail"]
    for dead in ("dead", "deadcluster"):
        assert status_of(rows, f"tiers[{dead}] reach") == "FAIL" and "cannot reach" in rows[f"tiers[{dead}] reach"][0]["detail"]
    assert status == 1
    for secret in (password, "wrong-pw-91", "dead-pw-55"):
        assert secret not in table and secret not in json_out[1]


def test_s3_bucket_listed_missing_or_unreachable(tmp_path, capsys):
    from tests.tiers.s3server import ACCESS_KEY, BUCKET, SECRET_KEY, shared_server

    srv = shared_server()
    common = {"kind": "s3", "capacity": "1GiB", "endpoint": srv.endpoint, "region": "us-east-1",
              "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [
        {**common, "name": "ok", "location": f"{BUCKET}/check"},
        {**common, "name": "nobucket", "location": "kvtier-check-no-such-bucket/x"},
        {**common, "name": "dead", "location": f"{BUCKET}/x", "endpoint": f"http://127.0.0.1:{free_port()}"}]})
    status, rows, table = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "tiers[ok] reach") == "OK"
    assert status_of(rows, "tiers[nobucket] reach") == "FAIL"
    assert "does not exist" in rows["tiers[nobucket] reach"][0]["detail"]
    assert status_of(rows, "tiers[dead] reach") == "FAIL" and "cannot reach" in rows["tiers[dead] reach"][0]["detail"]
    assert SECRET_KEY not in table and status == 1
    assert "kvtier-check-no-such-bucket" not in [b["Name"] for b in srv.client().list_buckets()["Buckets"]]


def test_key_file_ids_shown_key_never(tmp_path, shm_dir, capsys):
    keys = [auth.new_key(), auth.new_key()]
    key_file = tmp_path / "cluster.key"
    auth.write_key_file(str(key_file), keys)
    seal, accepted = auth.key_id(keys[0]).hex(), auth.key_id(keys[1]).hex()
    cfg = write_config(tmp_path / "kvtier.yaml", local_config(tmp_path, shm_dir, auth_key_file=str(key_file)))
    status, rows, table = check("--config", str(cfg), capsys=capsys)
    assert status == 0 and status_of(rows, "auth key") == "OK"
    assert seal in rows["auth key"][0]["detail"] and accepted in rows["auth key"][0]["detail"]
    for k in keys:
        assert k.hex() not in table
    status, rows, _ = check("--config", str(cfg), "--expect-key-id", seal.upper(), capsys=capsys)
    assert status == 0 and status_of(rows, "auth key id") == "OK"
    status, rows, _ = check("--config", str(cfg), "--expect-key-id", accepted, capsys=capsys)
    assert status == 0 and status_of(rows, "auth key id") == "WARN"  # a rotation half done
    status, rows, _ = check("--config", str(cfg), "--expect-key-id", "0123456789abcdef", capsys=capsys)
    assert status == 1 and status_of(rows, "auth key id") == "FAIL"
    key_file.chmod(0o644)
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status == 1 and status_of(rows, "auth key") == "FAIL" and "chmod 600" in rows["auth key"][0]["fix"]


def test_flags_are_checked(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--expect-key-id", "not-an-id"])
    assert exc.value.code == 2 and "16 hex digits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["check", "--config", "a.yaml", "--kv-transfer-config", "{}"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_no_key_is_fine_without_shared_tiers(tmp_path, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [{"kind": "disk", "path": str(tmp_path / "d"), "capacity": "1GiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "auth key") == "OK"
    status, rows, _ = check("--config", str(cfg), "--expect-key-id", "0123456789abcdef", capsys=capsys)
    assert status == 1 and status_of(rows, "auth key id") == "FAIL"


def test_bad_config_value_exits_2_naming_the_key(tmp_path, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [{"kind": "disk", "path": str(tmp_path), "capacity": "20"}]})
    status, rows, table = check("--config", str(cfg), capsys=capsys)
    assert status == 2 and status_of(rows, "config") == "FAIL"
    assert "tiers[0].capacity" in rows["config"][0]["detail"] and "20GiB" in rows["config"][0]["fix"]
    assert "exit status 2" in table
    status, rows, _ = check("--config", str(tmp_path / "absent.yaml"), capsys=capsys)
    assert status == 2 and "cannot read" in rows["config"][0]["detail"]


def test_kv_transfer_config_read_as_the_connector_reads_it(tmp_path, shm_dir, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", local_config(tmp_path, shm_dir))
    ktc = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"config": str(cfg), "chunk_tokens": 48, "vllm": {"load_decision": "auto"}}}
    status, rows, _ = check("--kv-transfer-config", json.dumps(ktc), "--block-size", "16", capsys=capsys)
    assert status_of(rows, "kv_transfer_config") == "OK"
    assert "chunk_tokens 48" in rows["config"][0]["detail"]  # the inline key overrides the file
    assert status_of(rows, "chunk size") == "OK" and status == 0
    status, rows, _ = check("--kv-transfer-config", json.dumps(ktc), "--block-size", "32", capsys=capsys)
    assert status == 1 and status_of(rows, "chunk size") == "FAIL"
    # vLLM's default policy fails requests on a miss: the connector refuses it.
    bad = {**ktc, "kv_connector_extra_config": {"config": str(cfg),
                                                "tiers": [{"kind": "redis", "address": "127.0.0.1:1",
                                                           "capacity": "1GiB", "password": "inline-pw-33"}]}}
    del bad["kv_load_failure_policy"]
    status, rows, table = check("--kv-transfer-config", json.dumps(bad), capsys=capsys)
    assert status == 1 and status_of(rows, "kv_transfer_config") == "FAIL"
    assert status_of(rows, "kv_connector_extra_config") == "FAIL"  # a credential vLLM would log
    assert "inline-pw-33" not in table
    unknown = {**ktc, "kv_connector_extra_config": {"config": str(cfg), "vllm": {"load_decisoin": "auto"}}}
    status, rows, _ = check("--kv-transfer-config", json.dumps(unknown), capsys=capsys)
    assert status == 2 and "vllm.load_decisoin" in rows["config"][0]["detail"]
    status, rows, _ = check("--kv-transfer-config", json.dumps({**ktc, "kv_role": "kv_consumer"}), capsys=capsys)
    assert status == 0 and status_of(rows, "kv_transfer_config") == "WARN"
    status, rows, _ = check("--kv-transfer-config", "{not json", capsys=capsys)
    assert status == 2 and "--kv-transfer-config" in rows["config"][0]["detail"]


def test_environment_as_the_engine_sees_it(tmp_path, shm_dir, monkeypatch, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", local_config(tmp_path, shm_dir))
    monkeypatch.setenv("KVTIER_CONFIG", str(cfg))
    monkeypatch.setenv("KVTIER_CHUNK_TOKENS", "96")
    monkeypatch.setenv("KVTIER_CHUNK_TOKEN", "128")  # a typo: ignored by kvtier, named here
    status, rows, _ = check(capsys=capsys)
    assert "chunk_tokens 96" in rows["config"][0]["detail"] and str(cfg) in rows["config"][0]["detail"]
    assert status_of(rows, "env KVTIER_CHUNK_TOKEN") == "WARN"
    assert "KVTIER_CHUNK_TOKENS" in rows["env KVTIER_CHUNK_TOKEN"][0]["detail"]
    assert status == 0


def test_config_file_with_credentials_readable_by_all_fails(tmp_path, capsys):
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [
        {"kind": "redis", "address": "127.0.0.1:1", "capacity": "1GiB", "password": "file-pw-12",
         "connect_timeout_s": 0.2}]}, mode=0o644)
    status, rows, table = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "config file") == "FAIL" and "chmod 600" in rows["config file"][0]["fix"]
    assert "file-pw-12" not in table


def test_vllm_release_rows():
    cases = {None: "WARN", "0.29.1": "FAIL", "0.30.0": "OK", "0.32.0+cpu": "OK", "0.33.1.dev4+g1a2b": "OK",
             "0.34.0": "WARN", "1.0.0": "WARN", "garbage": "FAIL"}
    for version, want in cases.items():
        report = Report()
        vllm_release(report, version)
        assert [r.status for r in report.rows] == [want], version


def test_secrets_are_replaced_in_every_output():
    report = Report()
    report.secret("s3cr3t-value")
    report.fail("tiers[x] reach", "server said: bad password s3cr3t-value", "not s3cr3t-value")
    text, doc = report.table(), json.dumps(report.as_json())
    assert "s3cr3t-value" not in text and "s3cr3t-value" not in doc
    assert "bad password ***" in text


def test_shared_folder_on_a_read_only_mount_fails(tmp_path, capsys):
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    assert mounted or os.geteuid() != 0, "root could not bind-mount: the read-only case was not tested"
    if not mounted:
        pytest.skip("bind mounts need root")
    try:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
        cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [{"kind": "shared", "path": str(ro), "capacity": "1MiB"}]})
        status, rows, _ = check("--config", str(cfg), capsys=capsys)
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
    assert status == 1 and status_of(rows, "tiers[shared] folder") == "FAIL"
    assert "read-only mount" in rows["tiers[shared] folder"][0]["detail"]
    assert status_of(rows, "tiers[shared] mount") == "OK" and str(ro) in rows["tiers[shared] mount"][0]["detail"]


def test_shared_objects_of_another_format_warn(shm_dir, tmp_path, capsys):
    from kvtier.codec import encode
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers.shared import SharedConfig, SharedTier

    ns = Namespace("m", "fp", "float16", "test", 2, 2, 8, chunk_tokens=16)
    key = chunk_keys(ns, list(range(16)))[0]
    with SharedTier(SharedConfig(path=str(shm_dir), capacity=1 << 20, gc_interval_s=0)) as t:
        assert t.store([encode(key, "float16", (2, 2, 2, 16, 8), bytes(2048))]) == 1
        obj = t.dir.path(key)
    cfg = write_config(tmp_path / "kvtier.yaml", {"tiers": [{"kind": "shared", "path": str(shm_dir), "capacity": "1MiB"}]})
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "tiers[shared] format") == "OK" and "as this kvtier writes" in rows["tiers[shared] format"][0]["detail"]
    with open(obj, "r+b") as f:  # what a release of another format would have written there
        f.seek(8)
        f.write((999).to_bytes(2, "little"))
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "tiers[shared] format") == "WARN" and "format 999" in rows["tiers[shared] format"][0]["detail"]
    (shm_dir / "kvtier-v9").mkdir()
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "tiers[shared] format") == "WARN" and "kvtier-v9" in rows["tiers[shared] format"][0]["detail"]
    # A FIFO planted where an object would be is no object, and no wait.
    obj.unlink()
    shutil.rmtree(shm_dir / "kvtier-v9")
    os.mkfifo(obj)
    status, rows, _ = check("--config", str(cfg), capsys=capsys)
    assert status_of(rows, "tiers[shared] format") == "OK" and "no object" in rows["tiers[shared] format"][0]["detail"]
