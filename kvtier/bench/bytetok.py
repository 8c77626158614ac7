"""A byte-level tokenizer for the models ``kvtier.bench.tinymodels`` builds,
so that text clients (a published benchmark client, ``/v1/chat``-style
servers) can drive them without a model hub.

    write_byte_tokenizer(model_dir, vocab_size)

Token ``b`` (0-255) is the byte ``b``; nothing merges, so every byte of a
prompt is one token and a text that extends another encodes to token ids
that extend the other's: a multi-turn client that resends the conversation
as text produces prompts that share their prefix token for token, what a
KV cache keys on. Ids 256 and up (up to the model's vocabulary, which a
dummy-weights model samples from) decode to three letters or digits: plain
ASCII, so an answer sent back as history never turns into replacement
characters, and costs at most three tokens per answer token there.

Written as Hugging Face's ``tokenizer.json`` (the ``tokenizers`` format:
a BPE model without merges behind the byte-level pre-tokenizer) and a
``tokenizer_config.json``: vLLM and ``transformers.AutoTokenizer`` load it
from the model directory, offline.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_alphabet() -> list[str]:
    """The 256 characters the byte-level pre-tokenizer maps bytes 0-255 to
    (GPT-2's table: printable bytes stand for themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return [chr(chars[b]) for b in range(256)]


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # byte-level chars that are themselves


def tokenizer_json(vocab_size: int) -> dict:
    if vocab_size < 256:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least 256, got {vocab_size}")
    if vocab_size > 256 + len(_ALNUM) ** 3:
        raise ValueError(f"vocabulary {vocab_size} too large for three-character filler tokens")
    vocab = {c: b for b, c in enumerate(_byte_alphabet())}
    n = len(_ALNUM)
    for i in range(256, vocab_size):
        k = i - 256
        vocab[_ALNUM[k // (n * n)] + _ALNUM[k // n % n] + _ALNUM[k % n]] = i
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_byte_tokenizer(model_dir: str | Path, vocab_size: int) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(vocab_size)))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False,
    }, indent=1))
    return out
