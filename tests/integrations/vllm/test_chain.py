"""The chunk keys of a request (chain.py) are the prefix chain ``kvtier.keys``
defines, under the request's tenant salt, whichever way they are asked."""

from __future__ import annotations

from kvtier.integrations.vllm.chain import KeyChains
from kvtier.keys import Namespace, chunk_keys

BS, C = 4, 8
NS = Namespace("m", "fp", "float32", "test", 1, 1, 4, chunk_tokens=C)
TOK = list(range(100, 130))  # 30 tokens: three full chunks, then 6


def test_a_prompts_keys_are_the_chain_over_its_whole_blocks():
    prompt = KeyChains(NS, C).chain("s").prompt(TOK, 28)
    assert list(prompt.keys) == chunk_keys(NS.with_salt("s"), TOK[:28])
    assert [k.num_tokens for k in prompt.keys] == [C, C, C, 4]


def test_saves_and_lookups_name_a_chunk_alike():
    chain = KeyChains(NS, C).chain(None)
    prompt = chain.prompt(TOK, 24)
    assert [chain.full(i, TOK) for i in range(3)] == list(prompt.keys)
    assert chain.tail(TOK, 24, 28) == chunk_keys(NS, TOK[:28])[-1]
    assert chain.tail(TOK, 0, 4) == chunk_keys(NS, TOK[:4])[-1]  # a prompt shorter than a chunk


def test_a_shorter_chunk_follows_the_full_ones_before_it():
    prompt = KeyChains(NS, C).chain("").prompt(TOK, 28)
    assert prompt.shorter(1, 4) == chunk_keys(NS, TOK[:12])[-1]
    assert prompt.shorter(0, 4) == chunk_keys(NS, TOK[:4])[-1]


def test_each_tenant_salt_roots_its_own_chain():
    chains = KeyChains(NS, C)
    a, b, none = chains.chain("a"), chains.chain("b"), chains.chain(None)
    assert a.root != b.root != none.root
    assert chains.chain("a").root is a.root  # made once per salt
    assert none.root == chains.chain("").root
