"""``kvtier auth keygen|id|add|promote|remove FILE``: the cluster's key file.

Every node of a cluster gives kvtier the same key file (``auth_key_file`` or
``KVTIER_AUTH_KEY_FILE``); docs/security.md says what it protects. A key is
rotated without a miss: ``add`` a new key (accepted, not yet sealing) and
give the file to every node; then ``promote`` it (it seals from then on) and
give the file out again; ``remove`` the old key once what it sealed no longer
matters (objects it sealed become misses on nodes without it).
"""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "auth", help="make and rotate the cluster key file that authenticates stored KV",
        description="kvtier seals every object it stores with the first key of the key file and serves only objects "
        "sealed with one of its keys, so nobody who can write a tier's storage but lacks the file can make an engine "
        "serve KV it did not compute. Give every node the same file (config auth_key_file, or KVTIER_AUTH_KEY_FILE). "
        "Key ids, never keys, are printed. See docs/security.md.")
    sub = p.add_subparsers(dest="auth", required=True)
    kg = sub.add_parser("keygen", help="write a new key file (mode 0600) holding one new key")
    kg.add_argument("file")
    kg.add_argument("--force", action="store_true", help="replace an existing file (its keys are lost)")
    kg.set_defaults(func=cmd_keygen)
    kid = sub.add_parser("id", help="print the key ids of a key file (the first seals); compare them across nodes")
    kid.add_argument("file")
    kid.set_defaults(func=cmd_id)
    add = sub.add_parser("add", help="add a new key, accepted but not sealing yet (rotation, step 1)")
    add.add_argument("file")
    add.set_defaults(func=cmd_add)
    pr = sub.add_parser("promote", help="make a key the one that seals (rotation, step 2)")
    pr.add_argument("file")
    pr.add_argument("key_id", help="the id `kvtier auth id` prints")
    pr.set_defaults(func=cmd_promote)
    rm = sub.add_parser("remove", help="drop a key: what it sealed is no longer served (rotation, step 3)")
    rm.add_argument("file")
    rm.add_argument("key_id", help="the id `kvtier auth id` prints")
    rm.set_defaults(func=cmd_remove)


def _keys(path: str) -> list[bytes]:
    from kvtier import auth

    return auth.read_key_file(path, "FILE")


def _find(keys: list[bytes], kid: str) -> int:
    from kvtier import auth
    from kvtier.errors import ConfigError

    ids = [auth.key_id(k).hex() for k in keys]
    if kid.lower() not in ids:
        raise ConfigError("key_id", f"no key with id {kid} in the file", f"use one of: {', '.join(ids)}")
    return ids.index(kid.lower())


def _show(keys: list[bytes]) -> None:
    from kvtier import auth

    for i, k in enumerate(keys):
        print(f"{auth.key_id(k).hex()}  {'seals and is accepted' if i == 0 else 'accepted'}")


def cmd_keygen(args: argparse.Namespace) -> int:
    from kvtier import auth
    from kvtier.errors import ConfigError

    keys = [auth.new_key()]
    try:
        auth.write_key_file(args.file, keys, replace=args.force and os.path.exists(args.file))
    except FileExistsError:
        raise ConfigError("FILE", f"{args.file} exists", "name a new file, or pass --force to replace it") from None
    except OSError as exc:
        raise ConfigError("FILE", f"cannot write {args.file}: {exc.strerror}", "name a writable place") from None
    _show(keys)
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    _show(_keys(args.file))
    return 0


def _rewrite(path: str, keys: list[bytes]) -> int:
    from kvtier import auth

    auth.write_key_file(path, keys, replace=True)
    _show(keys)
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from kvtier import auth

    keys = _keys(args.file)
    return _rewrite(args.file, keys[:1] + [auth.new_key()] + keys[1:])


def cmd_promote(args: argparse.Namespace) -> int:
    keys = _keys(args.file)
    i = _find(keys, args.key_id)
    return _rewrite(args.file, [keys[i]] + keys[:i] + keys[i + 1:])


def cmd_remove(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError

    keys = _keys(args.file)
    i = _find(keys, args.key_id)
    if len(keys) == 1:
        raise ConfigError("key_id", "it is the file's only key", "add another first, or delete the file to turn "
                          "authentication off")
    return _rewrite(args.file, keys[:i] + keys[i + 1:])
