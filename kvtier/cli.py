"""The ``kvtier`` command.

    kvtier bench storage|resume|soak ...   benchmarks (kvtier/bench/cli.py)
    kvtier demo ...                        the quick cold-resume benchmark (kvtier/bench/cli.py)
    kvtier store ls|stat|verify|gc --dir DIR   a directory tier's store (kvtier/admin/storecli.py)
    kvtier auth keygen|id|add|promote|remove FILE   the cluster key file (kvtier/admin/authcli.py)
    kvtier serve MODEL ...                 vLLM's server with kvtier (kvtier/serve.py)
    kvtier plan ...                        capacity planning (kvtier/plan/cli.py)
    kvtier check [--config FILE | --kv-transfer-config JSON]   a node before a rollout (kvtier/check/cli.py)

Adding a command: a module with ``register(subparsers)``, which adds its
parser(s) to argparse's ``subparsers`` and sets ``func`` (the handler: args
in, exit status out) with ``set_defaults``, joins ``COMMANDS``. A command
module imports only what its arguments need; its handlers import the work
when they run, so that ``kvtier --help`` loads none of it. No kvtier module
imports this one (``tests/test_imports.py``).

Exit codes: 0 ok, 1 a check failed (verify found bad objects), 2 bad usage or
configuration (the message names the key and the fix) or a file or folder
this user may not read or write (the message names it), 141 the reader of
the output went away (``kvtier store ls | head``: quietly, as ``ls`` does
when SIGPIPE ends it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvtier import serve
from kvtier.admin import authcli, storecli
from kvtier.bench import cli as bench_cli
from kvtier.check import cli as check_cli
from kvtier.errors import ConfigError
from kvtier.plan import cli as plan_cli
from kvtier.version import __version__

# In the order of ``kvtier --help``.
COMMANDS = (bench_cli, storecli, authcli, serve, plan_cli, check_cli)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered KV cache (host DRAM, local disk, shared storage) for LLM inference engines.",
    )
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, so that a reader gone away is caught below, not at exit
        return status
    except ConfigError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        where = exc.filename if exc.filename is not None else "a file it needs"
        print(f"kvtier: cannot access {where}: permission denied. Fix: run as a user who may "
              "(the folder's owner), or give this user access to it", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whatever is still buffered has nowhere to go: point stdout at
        # /dev/null so that the interpreter's last flush does not fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
