"""``kvtier check``: the parser (``register``), its handler and the order of
the checks (``run_checks``)."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Mapping

DESCRIPTION = """\
Checks what an engine with kvtier needs on this node before a rollout, as the
engine would read it, and prints a table: one row per check, OK, WARN or FAIL,
with the fix for each WARN and FAIL. It only looks: nothing is created or
written, on this node or on a server.

input (one of; with neither, KVTIER_CONFIG and the other KVTIER_* variables):
  --config FILE               the kvtier config file (as `kvtier serve --config`)
  --kv-transfer-config JSON   the argument vLLM gets; its kv_connector_extra_config
                              is read as the connector reads it (config names the file,
                              other keys override it)
  KVTIER_* variables apply beneath either, as in the engine, which inherits
  this environment: run the check as the engine's user, with its environment.

checks:
  config            keys and types parse (a bad value: the key and the fix);
                    KVTIER_* variables kvtier does not read; the config file's mode
                    (not writable by others; not readable by others if it holds
                    credentials); vLLM's own fields of --kv-transfer-config
  tier folders      memory (the node memory folder the connector keeps it in, on
                    tmpfs), shm, disk: this user's and writable by nobody else, or
                    creatable; shared: exists, writable, kvtier-v1 this user's, on
                    a mount of its own, its objects of this release's format;
                    free space against capacity
  redis, s3         reached with the configured credentials and TLS: PING, or a
                    listing of the tier's prefix (nothing is written)
  auth key          the cluster key file loads (mode, format) and its key ids,
                    never the keys; absent while a tier is shared: WARN;
                    --expect-key-id: this node seals with the same key as the others
  vllm              installed, and a release kvtier supports
  chunk size        chunk_tokens against the block size (--block-size)

exit status:
  0  no check FAILed (WARNs allowed, unless --strict)
  1  a check FAILed (or, with --strict, WARNed)
  2  the configuration could not be read (the row names the key and the fix),
     or a bad flag

Secrets (passwords, secret keys, cluster keys) are never printed.
"""


def _key_id(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{16}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a key id (16 hex digits, as `kvtier auth id FILE` prints)")
    return text.lower()


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number of tokens, got {text!r}")
    return n


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check a node before a rollout: config, folders, servers, cluster key, vLLM",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE", help="kvtier config file (default: $KVTIER_CONFIG)")
    src.add_argument("--kv-transfer-config", metavar="JSON", help="vLLM's --kv-transfer-config argument")
    p.add_argument("--expect-key-id", metavar="ID", type=_key_id,
                   help="the key id the other nodes seal with (`kvtier auth id FILE` on one of them): FAIL unless "
                        "this node seals with it too")
    p.add_argument("--block-size", metavar="N", type=_positive,
                   help="the engine's block size (vLLM's --block-size): chunk_tokens must be a multiple of it")
    p.add_argument("--strict", action="store_true", help="exit status 1 on a WARN too")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (check, status, detail, fix)")
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    report = run_checks(config=args.config, kv_transfer_config=args.kv_transfer_config,
                        expect_key_id=args.expect_key_id, block_size=args.block_size, environ=os.environ)
    if args.json:
        print(json.dumps(report.as_json(args.strict), indent=2))
    else:
        print(report.table(args.strict))
    return report.exit_status(args.strict)


def run_checks(config: str | None = None, kv_transfer_config: str | None = None, expect_key_id: str | None = None,
               block_size: int | None = None, environ: Mapping[str, str] | None = None):
    """Every check, in the order of the table; the ``Report``."""
    from kvtier.check import inputs, node
    from kvtier.check.report import Report
    from kvtier.tiers import registry

    report = Report()
    store = inputs.read(report, config, kv_transfer_config, os.environ if environ is None else environ)
    if store is None:
        return report
    checks = _tier_checks()
    for spec in store.tiers:
        check = checks.get(spec.kind)
        label = f"tiers[{spec.config.name}]"
        if check is None:
            report.ok(label, f"kind {spec.kind} (another package's): its config parses; kvtier check knows "
                      "nothing more to check of it")
        else:
            try:
                check(report, label, spec.config, store)
            except Exception as exc:  # whatever looking raised (a folder this user may not see, a TLS file): a row
                report.fail(label, f"could not be checked: {type(exc).__name__}: {exc}",
                            "run the check as the engine's user, with its environment; fix what the message names")
    shared = [t.config.name for t in store.tiers if registry.resolve(t.kind).shared_medium]
    node.cluster_key(report, store, shared, expect_key_id)
    node.vllm_release(report, node.installed_vllm())
    node.chunk_layout(report, store, block_size)
    return report


def _tier_checks() -> dict:
    """Tier kind -> its check: (report, row label, tier config, store config)."""
    from kvtier.check import folders, services
    from kvtier.tiers.shm import default_dir

    def memory(report, label, cfg, store):
        # The vLLM connector keeps it in the node's memory folder (topology.node_memory).
        root = store.node_memory_dir or default_dir()
        folders.private_folder(report, label, os.path.join(root, cfg.name), cfg.capacity, memory=True, root=root)

    def shm(report, label, cfg, store):
        root = None if cfg.path else default_dir()
        folders.private_folder(report, label, cfg.resolved().path, cfg.capacity, memory=True, root=root)

    return {
        "memory": memory,
        "shm": shm,
        "disk": lambda r, label, cfg, _: folders.private_folder(r, label, cfg.path, cfg.capacity, memory=False),
        "shared": lambda r, label, cfg, _: folders.shared_folder(r, label, cfg.path, cfg.capacity),
        "redis": lambda r, label, cfg, _: services.redis_tier(r, label, cfg),
        "s3": lambda r, label, cfg, _: services.s3_tier(r, label, cfg),
    }
