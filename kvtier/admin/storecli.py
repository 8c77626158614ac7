"""``kvtier store ls|stat|verify|gc --dir DIR``: a directory tier's store,
administered from outside the engines. Each command opens it with
``AdminStore`` (``admin/dirstore.py``), which tells the tier's kind and honours
its owner: ``ls`` and ``stat`` only look; ``verify`` and ``gc`` refuse a
running engine's disk tier (exit status 2, naming the fix) and work on a
shared directory from any node. ``gc`` deletes no more than a routine pass
would unless ``--yes`` confirms it (``dirstore.confirm``): a ``--capacity``
far below the tier's real one must not empty it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kvtier import argtypes, progress
from kvtier.errors import ConfigError


def register(subparsers) -> None:
    """``kvtier store ls|stat|verify|gc``."""
    store = subparsers.add_parser(
        "store", help="inspect and maintain a shared (or disk) tier directory; verify a Redis or S3 tier",
        description="ls, stat and verify only look: they open the directory read-only, create nothing and "
        "sweep nothing (a read-only mount works; a missing store is an error). Only gc (without --dry-run) "
        "and verify --quarantine write. The tier's kind is told from its folder: a disk tier has one owner, "
        "so verify and gc refuse its folder while an engine holds it (exit status 2); a shared directory "
        "takes them from any node at any time; a node memory tier (shm) is only looked at. verify --tier URL "
        "checks a Redis or S3 tier's objects instead (--quarantine deletes its bad ones: neither has a quarantine "
        "folder).")
    ssub = store.add_subparsers(dest="store", required=True)

    def common(sp):
        sp.add_argument("--dir", required=True, help="the tier's directory (as in its config: path)")
        return sp

    ls = common(ssub.add_parser("ls", help="list objects: namespace, key, bytes, last access"))
    ls.add_argument("--limit", type=int, default=0, help="stop after N objects")
    ls.set_defaults(func=cmd_store_ls)
    st = common(ssub.add_parser("stat", help="objects, bytes and namespaces held; temp and quarantined files"))
    st.add_argument("--capacity", type=argtypes.size, help="show usage against this capacity")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=cmd_store_stat)
    vf = ssub.add_parser(
        "verify", help="read every object and check its header and checksum",
        description="Read every object of a directory tier (--dir) or of a Redis or S3 tier (--tier) and check what "
        "it promises: its header, its name, its length and checksum, and with a cluster key file its seal. A Redis "
        "tier is opened as the engines open it (rediss:// for TLS, cluster=true, key_prefix=...; the password "
        "from KVTIER_REDIS_PASSWORD, never the URL) and walked through its index without touching any object's "
        "access order or TTL. An S3 tier (s3://BUCKET/PREFIX?endpoint=...; keys from KVTIER_S3_ACCESS_KEY_ID and "
        "KVTIER_S3_SECRET_ACCESS_KEY or boto3's chain, never the URL) is listed a page at a time and read with "
        "plain GETs, which leave LastModified as it is. Exit status 1 when an object is bad, 2 for a bad flag, "
        "an unreachable server or a missing bucket.")
    where = vf.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", help="the tier's directory (as in its config: path)")
    where.add_argument("--tier", metavar="URL",
                       help="a Redis tier, redis://HOST:PORT[?options], or an S3 tier, s3://BUCKET/PREFIX?endpoint=URL"
                            "[&options], as in its config (capacity may be left out)")
    vf.add_argument("--quarantine", action="store_true",
                    help="move bad objects to the store's quarantine folder, as the tiers do; a Redis or S3 tier has "
                         "no such folder: its bad objects are deleted, as its reads delete them (default: only report)")
    vf.add_argument("--no-quarantine", action="store_false", dest="quarantine", help=argparse.SUPPRESS)
    vf.add_argument("--no-progress", action="store_true", help="no progress bar")
    vf.add_argument("--auth-key-file", metavar="FILE", default=None,
                    help="also check each object's seal against this cluster key file, as an engine with it does "
                         "(default: $KVTIER_AUTH_KEY_FILE; without either, seals are not checked)")
    vf.set_defaults(func=cmd_store_verify)
    gc = common(ssub.add_parser(
        "gc",
        help="delete least recently used objects down to the low watermark",
        description="One collection pass: if usage exceeds HIGH x CAPACITY, delete the least recently used objects "
        "until usage is under LOW x CAPACITY; sweep dead writers' temp files. On a shared directory: safe from any "
        "instance at any time (a lease keeps two passes apart). On a disk tier's folder: only while no engine "
        "holds it (the tier's own eviction, by its access log). A pass that would delete more than a routine one "
        "(more than 25% of the objects or bytes, or than 1 - LOW/HIGH where that is more: the mark of a "
        "--capacity far below the tier's real one) deletes nothing and exits with status 2 unless --yes is given.",
    ))
    gc.add_argument("--capacity", type=argtypes.size, help="the tier's capacity, e.g. 10TiB (required)")
    gc.add_argument("--high-watermark", type=float, default=0.95, help="start collecting above this fraction (default 0.95)")
    gc.add_argument("--low-watermark", type=float, default=0.85, help="collect down to this fraction (default 0.85)")
    gc.add_argument("--dry-run", action="store_true",
                    help="list what would be deleted (namespace, key, bytes, last access; least recent first), "
                    "touching nothing (no lease, no sweep, no deletion)")
    gc.add_argument("--yes", action="store_true",
                    help="delete even where the pass takes more than a routine one would (see above)")
    gc.set_defaults(func=cmd_store_gc)


def _gc_config(args: argparse.Namespace):
    from kvtier.tiers.shared import SharedConfig

    cfg = SharedConfig(path=args.dir, capacity=args.capacity, gc_interval_s=0,
                       high_watermark=args.high_watermark, low_watermark=args.low_watermark)
    cfg.validate("")
    return cfg


def _look(args: argparse.Namespace):
    """The store at ``--dir``, opened to look only: nothing is created,
    swept, written or claimed (a missing store is an error; a read-only mount
    works; a running engine's disk tier is left be)."""
    from kvtier.admin.dirstore import AdminStore

    return AdminStore(args.dir).dir


def cmd_store_ls(args: argparse.Namespace) -> int:
    odir = _look(args)
    n = 0
    for e in odir.scan():
        print(_line(e))
        n += 1
        if args.limit and n >= args.limit:
            break
    return 0


def _line(e) -> str:
    """An object as ``ls`` lists it: namespace, key, bytes, last access."""
    ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.mtime))
    return f"{e.ns_hex}  {e.key_hex}  {e.size:>12}  {ts}"


def cmd_store_stat(args: argparse.Namespace) -> int:
    odir = _look(args)
    per_ns: dict[str, list[int]] = {}
    oldest, newest = None, None
    for e in odir.scan():
        c = per_ns.setdefault(e.ns_hex, [0, 0])
        c[0] += 1
        c[1] += e.size
        oldest = e.mtime if oldest is None else min(oldest, e.mtime)
        newest = e.mtime if newest is None else max(newest, e.mtime)
    tmp, quarantined = odir.count("tmp"), odir.count("quarantine")
    objects = sum(c[0] for c in per_ns.values())
    nbytes = sum(c[1] for c in per_ns.values())
    doc = {
        "directory": str(Path(args.dir).resolve()),
        "objects": objects,
        "bytes": nbytes,
        "namespaces": {k: {"objects": v[0], "bytes": v[1]} for k, v in sorted(per_ns.items())},
        "temp_files": tmp,
        "quarantined": quarantined,
        "oldest_access": oldest,
        "newest_access": newest,
    }
    if args.capacity:
        doc["capacity"] = args.capacity
        doc["used_fraction"] = nbytes / args.capacity
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"directory    {doc['directory']}")
    print(f"objects      {objects}")
    print(f"bytes        {nbytes} ({nbytes / (1 << 30):.2f} GiB)")
    if args.capacity:
        print(f"capacity     {args.capacity} ({100 * doc['used_fraction']:.1f}% used)")
    print(f"namespaces   {len(per_ns)}")
    for k, v in sorted(per_ns.items()):
        print(f"  {k}  {v[0]:>8} objects  {v[1] / (1 << 20):>10.1f} MiB")
    print(f"temp files   {tmp}")
    print(f"quarantined  {quarantined}")
    return 0


def cmd_store_verify(args: argparse.Namespace) -> int:
    from kvtier.auth import load_keyring
    from kvtier.admin.dirstore import AdminStore

    key_file = args.auth_key_file if args.auth_key_file is not None else os.environ.get("KVTIER_AUTH_KEY_FILE", "")
    keyring = load_keyring(key_file, "--auth-key-file") if key_file else None
    bars = progress.bars(not args.no_progress)
    if args.tier is not None:
        if args.tier.partition("://")[0] == "s3":
            from kvtier.admin.s3_verify import verify_s3 as verify_url
        else:
            from kvtier.admin.redis_verify import verify_redis as verify_url

        report = verify_url(args.tier, delete=args.quarantine, progress=bars, keyring=keyring)
        done, hint = "deleted", "left in place; --quarantine deletes them"
    else:
        with AdminStore(args.dir) as store:
            report = store.verify(quarantine=args.quarantine, progress=bars, keyring=keyring)
        done, hint = "quarantined", "left in place; --quarantine moves them aside"
    if keyring is None:
        print("seals not checked: no cluster key file (--auth-key-file or KVTIER_AUTH_KEY_FILE)")
    print(f"verified {report.ok} objects; {len(report.bad)} bad"
          + ((f" ({done})" if args.quarantine else f" ({hint})") if report.bad else ""))
    for path, why in report.bad[:50]:
        print(f"  {path}: {why}")
    return 0 if not report.bad else 1


def cmd_store_gc(args: argparse.Namespace) -> int:
    if not args.capacity:
        raise ConfigError("--capacity", "is required for gc", "pass the shared tier's capacity, e.g. --capacity 10TiB")
    from kvtier.admin.dirstore import AdminStore

    cfg = _gc_config(args)
    with AdminStore(args.dir) as store:  # an existing store only: gc never creates one
        r = store.gc(cfg, dry_run=args.dry_run, yes=args.yes)
    if not r.ran:
        print("another collector holds the lease; nothing done")
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(
        f"scanned {r.objects} objects, {r.bytes_before / (1 << 30):.2f} GiB; {verb} {r.deleted}; "
        f"now {r.bytes_after / (1 << 30):.2f} GiB of {args.capacity / (1 << 30):.2f} GiB; "
        f"swept {r.tmp_swept} temp and {r.quarantine_swept} quarantined files in {r.seconds:.1f}s"
    )
    for e in r.victims:  # a dry run's plan
        print(_line(e))
    return 0
