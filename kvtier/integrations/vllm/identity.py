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

Paths, mtimes and the model's local directory name never enter the
namespace: ``model_name`` is the hub id for a hub model and ``local`` for a
directory (the fingerprint tells directories apart).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

VERSION = "kvtier-model-v2"
SAMPLE_BYTES = 64 << 10
SAMPLE_BLOCKS = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt")
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size


def model_name(model: str) -> str:
    """What the namespace's ``model`` field holds: never a local path."""
    return "local" if Path(model).is_dir() else model


def fingerprint(model: str, *, revision: str | None = None, load_format: str = "", dtype: str = "",
                quantization: str | None = None, full: bool = False) -> str:
    """The weights' identity (hex SHA-256); see the module docstring."""
    h = hashlib.sha256()

    def field(tag: str, data: bytes) -> None:
        h.update(struct.pack("<Q", len(tag)) + tag.encode() + struct.pack("<Q", len(data)) + data)

    field("version", VERSION.encode())
    field("load_format", load_format.encode())
    field("dtype", dtype.encode())
    field("quantization", str(quantization or "").encode())
    field("revision", str(revision or "").encode())
    root = Path(model)
    if not root.is_dir():
        field("hub_id", model.encode())
        return h.hexdigest()
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
        elif p.suffix == ".safetensors" or p.suffix in _OTHER_WEIGHTS:
            field(f"weights:{p.name}", _full_digest(p) if full else _sampled(p))
    return h.hexdigest()


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
