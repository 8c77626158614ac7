"""``kvtier serve`` without vLLM: the command it builds and prints, and its
supervision (signals, process group, exit status) around a fake server.
With real vLLM servers: tests/integrations/vllm/test_serve.py."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvtier import serve
from kvtier.cli import main
from kvtier.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg(tmp_path) -> Path:
    (tmp_path / "kv").mkdir()  # the shared tier's folder (a mount point)
    p = tmp_path / "kvtier.yaml"
    p.write_text(f"chunk_tokens: 256\ntiers:\n  - kind: shared\n    path: {tmp_path / 'kv'}\n    capacity: 1GiB\n")
    return p


def _ktc(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_command_carries_the_connector_and_the_config_path(cfg, monkeypatch):
    cmd = serve.build_command("/models/m", ["--port", "8000"], config=str(cfg), launcher="module",
                              metrics_dir="/run/m", environ={})
    assert cmd.argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m"]
    assert cmd.argv[5:7] == ["--port", "8000"]
    assert _ktc(cmd.argv) == {
        "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": str(cfg.resolve())},
    }
    assert cmd.env["PROMETHEUS_MULTIPROC_DIR"] == "/run/m"
    # The printed line is the same command, shell-quoted.
    words = shlex.split(cmd.shell())
    assert words[:len(cmd.env)] == [f"{k}={v}" for k, v in cmd.env.items()]
    assert words[len(cmd.env):] == cmd.argv


def test_cli_launcher_puts_the_model_after_serve(cfg, tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "vllm"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setattr(serve.sys, "executable", str(tmp_path / "bin" / "python"))
    cmd = serve.build_command("m", [], config=str(cfg), launcher="cli", environ={})
    assert cmd.argv[:3] == [str(fake), "serve", "m"]


def test_auto_launcher_avoids_the_vllm_command_when_it_cannot_run(monkeypatch):
    monkeypatch.setattr(serve, "_has_distribution", lambda name: False)
    assert serve.vllm_launcher("auto")[1:] == ["-m", "vllm.entrypoints.openai.api_server"]


def test_inline_embeds_keys_but_refuses_credentials(cfg, tmp_path):
    cmd = serve.build_command("m", [], config=str(cfg), inline=True, launcher="module", environ={})
    assert _ktc(cmd.argv)["kv_connector_extra_config"]["tiers"][0]["kind"] == "shared"
    secret = tmp_path / "redis.yaml"
    secret.write_text("tiers:\n  - kind: redis\n    address: 127.0.0.1:6379\n    capacity: 1GiB\n    password: hunter2\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.password"):
        serve.build_command("m", [], config=str(secret), inline=True, launcher="module", environ={})


def test_environment_only_config_travels_in_the_printed_line():
    env = {"KVTIER_TIERS": "memory://?capacity=1GiB", "KVTIER_CHUNK_TOKENS": "512"}
    cmd = serve.build_command("m", [], launcher="module", environ=env)
    assert _ktc(cmd.argv)["kv_connector_extra_config"] == {}
    assert cmd.env["KVTIER_TIERS"] == "memory://?capacity=1GiB" and cmd.env["KVTIER_CHUNK_TOKENS"] == "512"


def test_refusals(cfg, tmp_path):
    with pytest.raises(ConfigError, match="--kv-transfer-config"):
        serve.build_command("m", ["--kv-transfer-config={}"], config=str(cfg), launcher="module", environ={})
    with pytest.raises(ConfigError, match="tiers"):
        serve.build_command("m", [], launcher="module", environ={})  # no config anywhere
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - kind: shared\n    path: /x\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity"):
        serve.build_command("m", [], config=str(bad), launcher="module", environ={})


def test_no_kvtier_runs_the_same_command_without_the_connector(cfg, capsys, monkeypatch):
    """The A/B baseline: kvtier serve's own vLLM command, minus the connector."""
    env = {"KVTIER_TIERS": "memory://?capacity=1GiB"}
    with_kv = serve.build_command("/m", ["--port", "8000"], config=str(cfg), launcher="module", metrics_dir="/run/m",
                                  tmp_dir="/run/t", environ=env)
    without = serve.build_command("/m", ["--port", "8000"], launcher="module", metrics_dir="/run/m", tmp_dir="/run/t",
                                  environ=env, connector=False)
    assert with_kv.argv[:-2] == without.argv and "--kv-transfer-config" not in without.argv
    assert without.env == {"PROMETHEUS_MULTIPROC_DIR": "/run/m", "TMPDIR": "/run/t"}
    with pytest.raises(ConfigError, match="--no-kvtier"):
        serve.build_command("/m", [], config=str(cfg), launcher="module", environ={}, connector=False)
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    monkeypatch.delenv("KVTIER_TIERS", raising=False)
    assert main(["serve", "/m", "--no-kvtier", "--launcher", "module", "--dry-run", "--port", "8001"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    assert words[-4:] == ["--model", "/m", "--port", "8001"]


def test_cli_dry_run_splits_kvtier_and_vllm_arguments(cfg, capsys, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    rc = main(["serve", "/models/m", "--port", "8001", "--config", str(cfg), "--launcher", "module",
               "--dry-run", "--", "--config", "vllm.yaml"])
    assert rc == 0
    out, err = capsys.readouterr()
    words = shlex.split(out.strip())
    argv = words[words.index(sys.executable):]
    assert argv[3:] == ["--model", "/models/m", "--port", "8001", "--config", "vllm.yaml",
                        "--kv-transfer-config", argv[-1]]
    assert _ktc(argv)["kv_connector_extra_config"] == {"config": str(cfg.resolve())}
    assert "PROMETHEUS_MULTIPROC_DIR" in err  # says how to get kvtier's metrics on /metrics


def _dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "-v", "serve", "m", "--launcher", "module", "--dry-run",
                           *args], env={**clean, **env}, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_dry_run_never_shows_a_credential(tmp_path):
    """Credentials given the documented ways (KVTIER_* variables, the config
    file) are used but never printed; in a tier URL they are refused (exit
    status 2), without being repeated."""
    secret = "Hq3-serve-never-shown"
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("tiers:\n  - {kind: redis, address: '127.0.0.1:6379', capacity: 1GiB, password: %s}\n"
                   "  - {kind: s3, name: s3b, location: bucket/p, capacity: 1GiB, access_key_id: AKID, "
                   "secret_access_key: %s}\n" % (secret, secret))
    env = {"KVTIER_TIERS": "redis://127.0.0.1:6379?capacity=1GiB,s3://bucket/p?capacity=1GiB&endpoint=http://127.0.0.1:1",
           "KVTIER_REDIS_PASSWORD": secret, "KVTIER_S3_ACCESS_KEY_ID": "AKID", "KVTIER_S3_SECRET_ACCESS_KEY": secret}
    for run in (_dry_run(env), _dry_run({}, "--config", str(cfg))):
        assert run.returncode == 0, run.stderr
        assert "--kv-transfer-config" in run.stdout and secret not in run.stdout + run.stderr
    for url in (f"redis://127.0.0.1:6379?capacity=1GiB&password={secret}",
                f"s3://bucket/p?capacity=1GiB&endpoint=http://AKID:{secret}@127.0.0.1:8333"):
        run = _dry_run({"KVTIER_TIERS": url})
        assert run.returncode == 2 and "tiers[0]." in run.stderr and "Traceback" not in run.stderr
        assert secret not in run.stdout + run.stderr


@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
def test_an_unmounted_shared_folder_exits_2_before_vllm_starts(cfg, tmp_path, capsys, monkeypatch, dry_run):
    """A shared tier's folder that is missing (a mount point not mounted)
    is refused here, not made on the local disk by the engine."""
    started = []
    monkeypatch.setattr(serve, "supervise", lambda cmd, **kw: started.append(cmd) or 0)
    (tmp_path / "kv").rmdir()
    assert main(["serve", "m", "--config", str(cfg), "--launcher", "module", *dry_run]) == 2
    err = capsys.readouterr().err
    assert "tiers[0].path" in err and f"{tmp_path / 'kv'} does not exist" in err and "Fix: mount" in err
    assert started == [] and not (tmp_path / "kv").exists()


def test_cli_bad_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{kind: memory}]\n")
    assert main(["serve", "m", "--config", str(bad), "--dry-run"]) == 2
    assert "tiers[0].capacity" in capsys.readouterr().err


@pytest.mark.parametrize("text,key", [
    ("tiers: [{kind: memory, capacity: .inf}]", "tiers[0].capacity"),
    ("tiers: [{kind: memory, capacity: 20}]", "tiers[0].capacity"),
    ("tiers: [{kind: memory, capacity: '20'}]", "tiers[0].capacity"),
    ("tiers: 5", "tiers"),
    ("tiers: [{kind: memory, capacity: 1GiB}]\nchunk_tokens: true", "chunk_tokens"),
    ("tiers: [{kind: disk, path: null, capacity: 1GiB}]", "tiers[0].path"),
    ("tiers: [{kind: memory, capacity: 1GiB, name: ../x}]", "tiers[0].name"),
    ("tiers: [{kind: memory, capacity: 1GiB}]\nload_timeout_s: .nan", "load_timeout_s"),
])
def test_cli_wrong_values_and_types_exit_2_naming_the_key(tmp_path, capsys, text, key):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "\n")
    assert main(["serve", "m", "--config", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "None").exists() and not Path("None").exists()


# ------------------------------------------------------------------ supervision

FAKE_SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    mode, pidfile = sys.argv[1], sys.argv[2]
    # A helper in the server's process group, as vLLM's engine core is.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    # What Intel's OpenMP leaves behind for a process that exits without unregistering.
    if os.path.isdir("/dev/shm"):
        open(f"/dev/shm/__KMP_REGISTERED_LIB_{helper.pid}_0", "w").close()
    def stop(sig, frame):
        if mode == "polite":
            sys.exit(0)  # leaves the helper behind on purpose
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    os.rename(pidfile + ".tmp", pidfile)
    if mode == "exit3":
        sys.exit(3)
    while True:
        time.sleep(0.05)
""")


def _start(tmp_path: Path, mode: str, stop_timeout: float = 30.0):
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pidfile = tmp_path / f"{mode}.pids"
    code = ("import sys; from kvtier.serve import ServeCommand, supervise; "
            f"sys.exit(supervise(ServeCommand([sys.executable, {str(script)!r}, {mode!r}, {str(pidfile)!r}]), "
            f"stop_timeout_s={stop_timeout}, orphan_grace_s=1.0))")
    sup = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    end = time.monotonic() + 30
    while not pidfile.exists():
        assert sup.poll() is None and time.monotonic() < end, "the fake server did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # the supervisor's handlers are installed before the server starts; let it settle
    server, helper = (int(x) for x in pidfile.read_text().split())
    return sup, server, helper


def _gone(*pids: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _cleanup(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for f in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
            f.unlink(missing_ok=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_forwarded_and_nothing_of_the_server_survives(tmp_path, sig):
    sup, server, helper = _start(tmp_path, "polite")
    try:
        sup.send_signal(sig)
        _, err = sup.communicate(timeout=30)
        assert sup.returncode == 0, err
        assert _gone(server, helper)
        assert f"{sig.name}: stopping the server" in err and "outlived it" in err
        assert not list(Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{helper}_*"))
    finally:
        _cleanup(server, helper)


def test_a_server_that_ignores_the_signal_is_killed_after_the_stop_timeout(tmp_path):
    sup, server, helper = _start(tmp_path, "stubborn", stop_timeout=1.0)
    try:
        t0 = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        _, err = sup.communicate(timeout=30)
        assert sup.returncode == 128 + signal.SIGKILL, err
        assert 1.0 <= time.monotonic() - t0 < 15
        assert _gone(server, helper)
    finally:
        _cleanup(server, helper)


def test_a_second_signal_kills_at_once(tmp_path):
    sup, server, helper = _start(tmp_path, "stubborn", stop_timeout=120.0)
    try:
        sup.send_signal(signal.SIGINT)
        time.sleep(0.5)
        t0 = time.monotonic()
        sup.send_signal(signal.SIGINT)
        _, err = sup.communicate(timeout=30)
        assert time.monotonic() - t0 < 10
        assert sup.returncode == 128 + signal.SIGKILL and "second signal" in err
        assert _gone(server, helper)
    finally:
        _cleanup(server, helper)


def test_the_servers_own_exit_status_is_returned(tmp_path):
    sup, server, helper = _start(tmp_path, "exit3")
    try:
        sup.communicate(timeout=30)
        assert sup.returncode == 3
        assert _gone(server, helper)
    finally:
        _cleanup(server, helper)


def test_a_killed_supervisor_takes_the_server_down(tmp_path):
    sup, server, helper = _start(tmp_path, "polite")
    try:
        sup.kill()
        sup.wait(timeout=30)
        sup.stderr.close()  # the helper still holds the pipe: no EOF to wait for
        assert _gone(server), "the parent-death signal must stop the server"
    finally:
        _cleanup(server, helper)
