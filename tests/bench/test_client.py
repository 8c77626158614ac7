"""``kvtier bench client``: GuideLLM (installed by ``kvtier[client]``) drives
plain vLLM and ``kvtier serve``, both real servers on loopback, on the tiny
model; and the byte-level tokenizer that lets GuideLLM run offline."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench import client_guidellm
from kvtier.bench.bytetok import write_byte_tokenizer

REPO = Path(__file__).resolve().parents[2]
SESSIONS, TURNS = 4, 3


def _kvtier(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_byte_tokenizer_extends_prompts_token_for_token(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(write_byte_tokenizer(tmp_path, 512)))
    assert len(tok) == 512
    first = "You are a helpful assistant. Tell me about caches.\n"
    answer = tok.decode([300, 72, 511, 105])  # what a dummy-weights model may answer
    assert answer.isascii() and answer.isprintable()
    history = first + " " + answer + " " + "And tiers?"
    assert tok.encode(history)[:len(tok.encode(first))] == tok.encode(first)
    assert len(tok.encode(first)) == len(first.encode())  # one token per byte: GuideLLM's lengths are exact


def test_missing_client_and_bad_flags_exit_2_with_the_fix(tmp_path):
    r = _kvtier("bench", "client", "--dir", str(tmp_path), "--guidellm", str(tmp_path / "no-such-guidellm"))
    assert r.returncode == 2 and "pip install 'kvtier[client]'" in r.stderr and "Traceback" not in r.stderr
    for flag, value in (("--turns", "0"), ("--concurrency", "0"), ("--model", "gpt-5"), ("--kv-blocks", "1")):
        r = _kvtier("bench", "client", "--dir", str(tmp_path), "--guidellm", sys.executable, flag, value)
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, (flag, r.stderr)


@pytest.mark.slow
def test_guidellm_drives_plain_vllm_and_kvtier_serve_and_kvtier_hits(tmp_path):
    assert client_guidellm.find() is not None, "GuideLLM missing: " + client_guidellm.INSTALL_HINT
    out = tmp_path / "run"
    r = _kvtier("bench", "client", "--model", "tiny-llama", "--dir", str(out), "--sessions", str(SESSIONS),
                "--turns", str(TURNS), "--prefix-tokens", "128", "--prompt-tokens", "256", "--output-tokens", "16",
                "--think", "1", "--processes", "single", "--json", str(tmp_path / "summary.json"), timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    vllm, kv = summary["sides"]["vllm"], summary["sides"]["kvtier"]
    for side in (vllm, kv):
        # Every request of every conversation answered, as GuideLLM and the server count them.
        assert side["requests_ok"] == SESSIONS * TURNS and side["requests_failed"] == 0, side
        assert side["server"]["requests"] == SESSIONS * TURNS, side
        assert all(side["ttft_ms"][p] > 0 for p in ("p50", "p90", "p99")), side
        assert side["output_tokens_per_s"] > 0 and side["requests_per_s"] > 0, side
        assert Path(side["server_log"]).exists()
    # Like for like: the two servers' commands differ only in kvtier's connector.
    a, b = shlex.split(vllm["server_command"]), shlex.split(kv["server_command"])
    port = lambda argv: argv[argv.index("--port") + 1]  # noqa: E731
    assert a[a.index("--no-kvtier") + 1:] == [w if w != port(b) else port(a) for w in b[b.index("--config") + 2:]]
    assert summary["client"]["name"] == "guidellm" and summary["client"]["version"].startswith("0.8")
    # Returning sessions were served from kvtier's tiers on the kvtier side only.
    assert kv["kvtier_hit_tokens"] > 0 and kv["server"]["external_prefix_cache_hits"] > 0, kv["server"]
    assert vllm["kvtier_hit_tokens"] == 0 and vllm["server"]["external_prefix_cache_hits"] == 0, vllm["server"]
    assert set(summary["ratio"]) == {"ttft_p50", "ttft_p90", "ttft_p99", "output_tokens_per_s", "requests_per_s"}
    assert all(v > 0 for v in summary["ratio"].values()), summary["ratio"]
    assert (out / "vllm" / "guidellm.json").exists() and (out / "kvtier" / "guidellm.json").exists()
    table = r.stdout
    assert "kvtier/vllm" in table and "TTFT p50" in table and f"{SESSIONS * TURNS}/{SESSIONS * TURNS}" in table
