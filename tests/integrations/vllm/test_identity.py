"""The model's identity: same content → same fingerprint wherever and
whenever it was copied; other content → another fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from kvtier.bench.tinymodels import build_checkpoint
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.identity import fingerprint, hub_snapshot, model_name


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
    pinned = "0" * 40  # a hub id with a pinned commit, its snapshot not at hand
    assert fingerprint("org/model", revision=pinned, load_format="auto") != fingerprint(
        "org/model2", revision=pinned, load_format="auto")


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


# ---------------------------------------------------------------- hub ids
# A model named by its hub id is read from the snapshot vLLM downloaded into
# a Hugging Face cache. The caches below are laid out as huggingface_hub
# writes them: blobs named by their hash, snapshot entries linking to them,
# refs/main naming the commit.

REPO = "kvtier-test/tiny-llama"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def _hub_cache(cache, src, commit, ref="main"):
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for p in src.iterdir():
        blob = repo / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(os.path.relpath(blob, snap))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def hub_env(monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def retrained(ckpt, tmp_path_factory):
    """The same model with other weights: one tensor changed, shapes kept."""
    copy = _copy(ckpt, tmp_path_factory.mktemp("ident") / "retrained")
    tensors = load_file(copy / "model.safetensors")
    name = sorted(tensors)[len(tensors) // 2]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_hub_snapshots_with_other_weights_do_not_share(ckpt, retrained, tmp_path, hub_env):
    _hub_cache(tmp_path / "node-a", ckpt, COMMIT_A)
    _hub_cache(tmp_path / "node-b", retrained, COMMIT_B)
    _hub_cache(tmp_path / "node-c", ckpt, COMMIT_B)  # the same weights under another commit
    fps = {}
    for node in ("node-a", "node-b", "node-c"):
        hub_env.setenv("HF_HUB_CACHE", str(tmp_path / node))
        fps[node] = _fp(REPO)
    assert fps["node-a"] != fps["node-b"]
    assert fps["node-a"] == fps["node-c"]
    assert model_name(REPO) == REPO


def test_hub_cache_is_found_where_huggingface_hub_looks(ckpt, tmp_path, hub_env):
    _hub_cache(tmp_path / "home" / "hub", ckpt, COMMIT_A)
    hub_env.setenv("HF_HOME", str(tmp_path / "home"))
    via_home = _fp(REPO)
    hub_env.delenv("HF_HOME")
    hub_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _hub_cache(tmp_path / "xdg" / "huggingface" / "hub", ckpt, COMMIT_A)
    assert _fp(REPO) == via_home
    # vLLM's download_dir holds its own snapshots and wins over the cache.
    other = _hub_cache(tmp_path / "downloads", ckpt, COMMIT_B)
    assert hub_snapshot(REPO, download_dir=str(tmp_path / "downloads")) == other
    assert _fp(REPO, download_dir=str(tmp_path / "downloads")) == via_home


def test_a_pinned_revision_reads_its_own_snapshot(ckpt, retrained, tmp_path, hub_env):
    cache = tmp_path / "cache"
    _hub_cache(cache, ckpt, COMMIT_A, ref=None)
    _hub_cache(cache, retrained, COMMIT_B)  # main
    (cache / ("models--" + REPO.replace("/", "--")) / "refs" / "v1").write_text(COMMIT_A)  # a tag
    hub_env.setenv("HF_HUB_CACHE", str(cache))
    assert hub_snapshot(REPO).name == COMMIT_B
    assert hub_snapshot(REPO, COMMIT_A).name == COMMIT_A
    assert hub_snapshot(REPO, "v1").name == COMMIT_A
    assert _fp(REPO, revision=COMMIT_A) != _fp(REPO, revision=COMMIT_B)


def test_a_hub_id_without_its_snapshot_or_a_pinned_commit_is_refused(ckpt, tmp_path, hub_env):
    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    for revision in (None, "main", "v1.0"):
        with pytest.raises(ConfigError) as exc:
            _fp(REPO, revision=revision)
        assert exc.value.key == "model" and "revision" in exc.value.fix and "model_fingerprint" in exc.value.fix
    # A snapshot that holds no weights (config and tokenizer only) is not the weights either.
    snap = _hub_cache(tmp_path / "empty", ckpt, COMMIT_A)
    for p in snap.glob("*.safetensors"):
        p.unlink()
    with pytest.raises(ConfigError):
        _fp(REPO)
    assert _fp(REPO, load_format="dummy")  # random weights from vLLM's seed: none to read
    # A pinned commit stands for the weights where no snapshot is at hand.
    assert _fp(REPO, revision=COMMIT_B) != _fp(REPO, revision="c" * 40)


def test_a_single_file_checkpoint_is_local_and_read(ckpt, retrained, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shutil.copyfile(ckpt / "model.safetensors", a)
    shutil.copyfile(retrained / "model.safetensors", b)
    assert model_name(str(a)) == "local"
    assert _fp(a) != _fp(b)
    assert _fp(a) == _fp(shutil.copyfile(a, tmp_path / "elsewhere.gguf"))


def test_the_connector_reads_vllms_download_dir(ckpt, tmp_path, hub_env):
    from types import SimpleNamespace

    from kvtier.integrations.vllm.namespace import model_fingerprint

    hub_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    _hub_cache(tmp_path / "downloads", ckpt, COMMIT_A)

    def vllm_config(download_dir):
        return SimpleNamespace(
            model_config=SimpleNamespace(model=REPO, revision=None, dtype="torch.float32", quantization=None),
            load_config=SimpleNamespace(load_format="auto", download_dir=download_dir))

    assert model_fingerprint(vllm_config(str(tmp_path / "downloads"))) == _fp(
        REPO, download_dir=str(tmp_path / "downloads"))
    with pytest.raises(ConfigError):
        model_fingerprint(vllm_config(None))
    assert model_fingerprint(vllm_config(None), "release-7") == "release-7"  # pinned by hand: nothing read
