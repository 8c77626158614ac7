"""The model's identity: same content → same fingerprint wherever and
whenever it was copied; other content → another fingerprint."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvtier.bench.tinymodels import build_checkpoint
from kvtier.integrations.vllm.identity import fingerprint, model_name


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint("tiny-llama", tmp_path_factory.mktemp("ident") / "model")


def _copy(src, dst, shift_mtime: float = 0.0):
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        st = p.stat()
        os.utime(p, (st.st_atime + shift_mtime, st.st_mtime + shift_mtime))
    return dst


def _fp(path, **kw) -> str:
    kw.setdefault("load_format", "auto")
    kw.setdefault("dtype", "torch.float32")
    return fingerprint(str(path), **kw)


def test_copies_at_other_paths_and_times_share(ckpt, tmp_path):
    copy = _copy(ckpt, tmp_path / "elsewhere" / "other-name", shift_mtime=-86400)
    # A config rewritten by another tool: other formatting, another path recorded in it.
    cfg = json.loads((copy / "config.json").read_text())
    cfg["_name_or_path"] = "/somewhere/else"
    cfg["transformers_version"] = "0.0.0"
    (copy / "config.json").write_text(json.dumps(cfg, indent=4))
    assert _fp(copy) == _fp(ckpt)
    assert model_name(str(copy)) == model_name(str(ckpt)) == "local"
    assert model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_one_changed_tensor_does_not_share(ckpt, tmp_path):
    copy = _copy(ckpt, tmp_path / "changed")
    tensors = load_file(copy / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 1e-3  # same shapes, same dtype, same offsets
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert _fp(copy) != _fp(ckpt)


def test_dtype_quantization_revision_and_dummy_weights_do_not_share(ckpt):
    base = _fp(ckpt)
    assert _fp(ckpt, dtype="torch.bfloat16") != base
    assert _fp(ckpt, quantization="fp8") != base
    assert _fp(ckpt, revision="abc123") != base
    assert _fp(ckpt, load_format="dummy") != base
    assert fingerprint("org/model", load_format="auto") != fingerprint("org/model2", load_format="auto")


def test_full_digest_sees_what_samples_cannot_and_is_cached(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = _copy(ckpt, tmp_path / "deep")
    tensors = load_file(copy / "model.safetensors")
    name = max(tensors, key=lambda k: tensors[k].numel())  # larger than one sample
    flat = tensors[name].reshape(-1).clone()
    assert flat.numel() * 4 > 64 << 10
    flat[-1] += 1.0  # one element past every sample
    tensors[name] = flat.reshape(tensors[name].shape)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert _fp(copy) == _fp(ckpt)  # the documented blind spot of sampling
    assert _fp(copy, full=True) != _fp(ckpt, full=True)
    cache = json.loads((tmp_path / "cache" / "kvtier" / "digests.json").read_text())
    assert len(cache) == 2
    assert _fp(copy, full=True) == _fp(copy, full=True)
