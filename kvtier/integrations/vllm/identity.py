"""The model's identity in the namespace: from the model's content, never
from where or when its files were copied.

Two nodes that downloaded or rsynced the same weights must share KV; two
engines whose weights differ in one tensor must not. Hashing every byte of a
100 GB checkpoint at each start is too slow, so the fingerprint hashes what
identifies the weights cheaply:

- the load format (vLLM's dummy weights never share with real ones), the
  dtype and quantization vLLM resolved, and the revision when one is given;
- ``config.json`` as parsed JSON (keys sorted; ``_name_or_path``-style keys
  starting with ``_`` and ``transformers_version`` left out: they name where
  and with what a file was written, not the model), and the tokenizer's
  files byte for byte;
- for each safetensors file: its name, size and header (every tensor's
  name, dtype, shape and offsets), and the first ``SAMPLE_BYTES`` of every
  tensor's data, so that retrained or edited weights of the same shapes
  differ too; other weight files (``.bin``, ``.pt``, ``.gguf``): name, size
  and ``SAMPLE_BLOCKS`` blocks spread over the file;
- the shard index (``*.index.json``) as parsed JSON.

What it cannot see: an edit confined to bytes no sample covers (a single
element deep inside a tensor). ``model_fingerprint: full`` in
``kv_connector_extra_config`` hashes every byte instead, once per file
version: the digest is cached in ``$XDG_CACHE_HOME/kvtier/digests.json``
(``~/.cache``), keyed by the file's absolute path, size and mtime (only to
know when to hash again; they never enter the identity). Any other string
given as ``model_fingerprint`` is used as is.

A model named by its hub id is fingerprinted the same way, from the snapshot
vLLM loaded: the folder ``snapshots/COMMIT`` of its Hugging Face cache
(vLLM's ``download_dir`` when one is set, else ``HF_HUB_CACHE``), COMMIT
being the pinned revision or what ``refs/REVISION`` (default ``main``)
names. Two nodes with other snapshots of one id hold other weights and so
share nothing; the commit a branch resolves to does not enter (only the
revision as vLLM was given it), so nodes that downloaded the same weights at
different commits share. Where no snapshot with weight
files is found, a revision pinned to a commit hash stands for the content;
without one the model is refused (``ConfigError``): an id alone names
whatever the hub served each node.

Paths, mtimes and the model's local directory name never enter the
namespace: ``model_name`` is the hub id for a hub model and ``local`` for a
directory or file (the fingerprint tells them apart).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from pathlib import Path

from kvtier.errors import ConfigError

VERSION = "kvtier-model-v2"
SAMPLE_BYTES = 64 << 10
SAMPLE_BLOCKS = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt")
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size
_COMMIT = re.compile(r"[0-9a-f]{40}")


def model_name(model: str) -> str:
    """What the namespace's ``model`` field holds: never a local path."""
    return "local" if Path(model).exists() else model


def fingerprint(model: str, *, revision: str | None = None, load_format: str = "", dtype: str = "",
                quantization: str | None = None, full: bool = False, download_dir: str | None = None) -> str:
    """The weights' identity (hex SHA-256); see the module docstring.
    ``download_dir``: vLLM's (``LoadConfig.download_dir``), where it keeps
    hub snapshots instead of Hugging Face's cache. Raises ConfigError for a
    hub id whose snapshot is not on this node and whose revision is not a
    commit hash."""
    h = hashlib.sha256()

    def field(tag: str, data: bytes) -> None:
        h.update(struct.pack("<Q", len(tag)) + tag.encode() + struct.pack("<Q", len(data)) + data)

    field("version", VERSION.encode())
    field("load_format", load_format.encode())
    field("dtype", dtype.encode())
    field("quantization", str(quantization or "").encode())
    field("revision", str(revision or "").encode())
    root = Path(model)
    if root.is_file():  # a single-file checkpoint (GGUF)
        field(f"weights:{root.suffix}", _full_digest(root) if full else _sampled(root))
        return h.hexdigest()
    if not root.is_dir():
        snapshot = hub_snapshot(model, revision, download_dir, weights=load_format != "dummy")
        if snapshot is None:
            if load_format != "dummy" and not _COMMIT.fullmatch(revision or ""):
                raise ConfigError(
                    "model", f"no snapshot of hub model {model!r} with weight files in "
                    f"{_hub_cache(download_dir)}, and no commit pinned: its identity would be the id alone, "
                    "which names whatever the hub served each node",
                    "pin the commit (vLLM --revision <40-hex commit hash>), or set model_fingerprint in "
                    "kv_connector_extra_config to a string that names these weights")
            field("hub_id", model.encode())
            return h.hexdigest()
        root = snapshot
    config = root / "config.json"
    if config.is_file():
        field("config", _canonical_config(config))
    for name in _TOKENIZER_FILES:
        p = root / name
        if p.is_file():
            field(f"tokenizer:{name}", hashlib.sha256(p.read_bytes()).digest())
    if load_format == "dummy":
        return h.hexdigest()  # random weights from vLLM's seed: no file is read
    for p in sorted(root.iterdir(), key=lambda q: q.name):
        if not p.is_file():
            continue
        if p.name.endswith(".index.json"):
            field(f"index:{p.name}", _canonical_json(p.read_bytes()))
        elif _is_weights(p):
            field(f"weights:{p.name}", _full_digest(p) if full else _sampled(p))
    return h.hexdigest()


def _is_weights(p: Path) -> bool:
    return p.suffix == ".safetensors" or p.suffix in _OTHER_WEIGHTS


def _hub_cache(download_dir: str | None) -> Path:
    """Where vLLM keeps hub snapshots: its ``download_dir``, else Hugging
    Face's cache (``HF_HUB_CACHE``, ``HF_HOME/hub``, ``~/.cache/huggingface/hub``),
    read from the environment as ``huggingface_hub`` reads it."""
    if download_dir:
        return Path(download_dir).expanduser()
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_snapshot(model: str, revision: str | None = None, download_dir: str | None = None, *,
                 weights: bool = True) -> Path | None:
    """The folder of hub model ``model``'s snapshot at ``revision`` (a commit
    hash, or a branch or tag named in ``refs/``; default ``main``) in vLLM's
    download folder or the Hugging Face cache, or None where there is none
    (or, with ``weights``, none holding a weight file). Reads only the
    local cache: never the network."""
    repo = _hub_cache(download_dir) / ("models--" + model.replace("/", "--"))
    rev = revision or "main"
    commit = rev
    if not _COMMIT.fullmatch(rev):
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except (OSError, ValueError):
            return None
    if not _COMMIT.fullmatch(commit):
        return None
    folder = repo / "snapshots" / commit
    try:
        if not folder.is_dir() or (weights and not any(_is_weights(p) and p.is_file() for p in folder.iterdir())):
            return None
    except OSError:
        return None
    return folder


def _canonical_json(data: bytes) -> bytes:
    try:
        return json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return data  # not JSON after all: its bytes are its identity


def _canonical_config(path: Path) -> bytes:
    try:
        cfg = json.loads(path.read_bytes())
    except ValueError:
        return path.read_bytes()
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "transformers_version"}
    return json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()


def _sampled(path: Path) -> bytes:
    """Size, format header and content samples of one weight file."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if 0 < n <= min(_MAX_HEADER, size - 8):
                header = f.read(n)
                h.update(header)
                try:
                    tensors = json.loads(header)
                except ValueError:
                    tensors = {}
                base = 8 + n
                for name in sorted(k for k in tensors if k != "__metadata__"):
                    offsets = tensors[name].get("data_offsets") if isinstance(tensors[name], dict) else None
                    if not offsets or len(offsets) != 2:
                        continue
                    start, end = int(offsets[0]), int(offsets[1])
                    f.seek(base + start)
                    h.update(f.read(max(0, min(SAMPLE_BYTES, end - start))))
                return h.digest()
        # Not safetensors (or an unreadable header): blocks spread over the file.
        step = max(1, size // SAMPLE_BLOCKS)
        for i in range(SAMPLE_BLOCKS + 1):
            f.seek(min(i * step, max(0, size - SAMPLE_BYTES)))
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()


_cache_lock = threading.Lock()


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "kvtier" / "digests.json"


def _full_digest(path: Path) -> bytes:
    """SHA-256 of every byte, computed once per file version (cached)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache = _cache_path()
    with _cache_lock:
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return bytes.fromhex(known[key])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.digest()
    with _cache_lock:
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        known[key] = digest.hex()
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home: hash again next time
    return digest
