"""The tier contract, one suite run unchanged against every tier kind.

A new tier joins by adding a ``Harness`` to ``HARNESSES``: how to open it
(again) on the same storage, how to let its capacity enforcement finish, and
how to make the next operation strictly more recent than the last. Nothing
else here names a kind.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.buffers import BufferPool, LoadBuffers
from kvtier.tiers.base import Tier
from tests.support import (
    OBJ,
    assert_object,
    make_chunks,
    objs_for,
    payload_for,
)



from tests.tiers.harness import CAP, HARNESSES


@pytest.fixture(params=sorted(HARNESSES))
def harness(request, tmp_path, metrics):
    h = HARNESSES[request.param](tmp_path, metrics)
    yield h
    h.close_all()


@pytest.fixture
def tier(harness) -> Tier:
    return harness.open()


def consume(tier: Tier, keys, check=True) -> int:
    """Fetch ``keys``; verify each object while it is lent; return the count."""
    n = 0
    for obj in tier.fetch(keys):
        if check:
            assert_object(obj, keys[n])
        n += 1
    return n


def present(tier: Tier, keys) -> list[int]:
    return [i for i, k in enumerate(keys) if tier.lookup([k]) == 1]


# ---------------------------------------------------------------- lookup


def test_lookup_of_nothing_and_on_an_empty_tier(tier):
    c = make_chunks(4)
    assert tier.lookup([]) == 0
    assert tier.lookup(c.keys) == 0


def test_lookup_full_and_partial_prefix(tier):
    c = make_chunks(6)
    assert tier.store(c.objs[:3]) == 3
    assert tier.lookup(c.keys) == 3
    assert tier.lookup(c.keys[:2]) == 2
    assert tier.store(c.objs[3:]) == 3
    assert tier.lookup(c.keys) == 6


def test_lookup_stops_at_a_gap(tier):
    c = make_chunks(6)
    assert tier.store(c.objs[:2] + c.objs[3:]) == 5
    assert tier.lookup(c.keys) == 2
    assert tier.lookup(c.keys[2:]) == 0
    assert tier.lookup(c.keys[3:]) == 3


def test_lookup_matches_keys_not_positions(tier):
    a, b = make_chunks(3, seed=1), make_chunks(3, seed=2)
    tier.store(a.objs)
    assert tier.lookup(b.keys) == 0
    assert tier.lookup(a.keys[:1] + b.keys[1:]) == 1


# ---------------------------------------------------------------- fetch and load


def test_fetch_yields_verified_objects_in_key_order(tier):
    c = make_chunks(8)
    tier.store(list(reversed(c.objs)))  # storage order does not matter
    assert consume(tier, c.keys) == 8


def test_fetch_stops_at_the_first_miss(tier):
    c = make_chunks(6)
    tier.store(c.objs[:2] + c.objs[3:])
    assert consume(tier, c.keys) == 2
    assert consume(tier, c.keys[2:]) == 0
    assert consume(tier, c.keys[3:]) == 3
    assert consume(tier, []) == 0


def test_an_abandoned_fetch_leaves_the_tier_usable(tier):
    c = make_chunks(6)
    tier.store(c.objs)
    it = tier.fetch(c.keys)
    assert_object(next(it), c.keys[0])
    it.close()
    assert tier.delete(c.keys) == 6  # nothing is still held by the abandoned read
    assert tier.lookup(c.keys) == 0


def test_load_copies_payloads_into_caller_buffers(tier):
    c = make_chunks(5)
    tier.store(c.objs)
    bufs = [bytearray(len(p)) for p in c.payloads]
    assert tier.load(c.keys, bufs) == 5
    assert [bytes(b) for b in bufs] == c.payloads


def test_load_into_views_of_one_caller_buffer(tier):
    c = make_chunks(4)
    tier.store(c.objs)
    size = len(c.payloads[0])
    big = bytearray(4 * size)
    views = [memoryview(big)[i * size : (i + 1) * size] for i in range(4)]
    assert tier.load(c.keys, views) == 4
    assert bytes(big) == b"".join(c.payloads)


def test_load_into_lent_buffers_and_again_into_the_same(tier):
    """Buffers a store lends (``LoadBuffers``): read in place where the tier
    can, copied into elsewhere; reused by the next load; another payload
    size loads nothing."""
    c = make_chunks(5)
    tier.store(c.objs[:4])
    lent = LoadBuffers(BufferPool(), 5, len(c.payloads[0]))
    for _ in range(2):
        assert tier.load(c.keys, lent) == 4
        assert [bytes(lent.payload(i)) for i in range(4)] == c.payloads[:4]
    assert tier.load(c.keys[1:], lent[2:]) == 3
    assert [bytes(lent.payload(i)) for i in range(2, 5)] == c.payloads[1:4]
    assert tier.load(c.keys, LoadBuffers(BufferPool(), 2, len(c.payloads[0]) + 4096)) == 0


def test_load_stops_at_a_wrong_size_buffer(tier):
    c = make_chunks(5)
    tier.store(c.objs)
    bufs = [bytearray(len(p)) for p in c.payloads]
    bufs[2] = bytearray(len(c.payloads[2]) - 1)
    assert tier.load(c.keys, bufs) == 2
    assert [bytes(b) for b in bufs[:2]] == c.payloads[:2]
    assert bytes(bufs[2]) == bytes(len(bufs[2]))  # never written


def test_load_stops_at_a_miss_and_at_the_last_buffer(tier):
    c = make_chunks(5)
    tier.store(c.objs[:3])
    bufs = [bytearray(len(p)) for p in c.payloads]
    assert tier.load(c.keys, bufs) == 3
    assert tier.load(c.keys, bufs[:2]) == 2


# ---------------------------------------------------------------- store, delete, stats


def test_store_is_idempotent(tier, harness):
    c = make_chunks(4)
    assert tier.store(c.objs) == 4
    before = tier.stats()
    again = objs_for(c.keys)  # equal objects, freshly encoded
    assert tier.store(again) == 4
    assert tier.store(c.objs) == 4
    assert tier.stats() == before
    assert tier.lookup(c.keys) == 4
    assert consume(tier, c.keys) == 4
    assert harness.metrics.value("kvtier_store_skipped_chunks_total", tier=tier.name) == 8


def test_delete(tier):
    c = make_chunks(4)
    tier.store(c.objs)
    assert tier.delete([c.keys[1]]) == 1
    assert tier.lookup(c.keys) == 1
    assert tier.delete([c.keys[1]]) == 0
    assert tier.delete(c.keys) == 3
    assert tier.lookup(c.keys) == 0
    assert tier.delete([]) == 0
    assert consume(tier, c.keys) == 0


class Heard:
    """A tier's removal listener (``Tier.on_removed``)."""

    def __init__(self, tier: Tier):
        self.digests: set[bytes] = set()
        self.names: set[str] = set()
        tier.on_removed = self

    def __call__(self, name: str, digests: list[bytes]) -> None:
        self.names.add(name)
        self.digests.update(digests)


def test_a_listener_hears_what_delete_removed(tier):
    heard = Heard(tier)
    c = make_chunks(4)
    tier.store(c.objs)
    tier.delete(c.keys[1:3])
    assert heard.digests == {k.digest for k in c.keys[1:3]} and heard.names == {tier.name}


def test_stats_follow_operations(tier, harness):
    s = tier.stats()
    assert (s.name, s.kind, s.objects, s.used_bytes, s.capacity_bytes) == (harness.name, harness.tier_kind, 0, 0, CAP)
    c = make_chunks(5)
    tier.store(c.objs[:3])
    s = tier.stats()
    assert (s.objects, s.used_bytes) == (3, 3 * OBJ)
    tier.store(c.objs)
    assert (tier.stats().objects, tier.stats().used_bytes) == (5, 5 * OBJ)
    tier.delete(c.keys[:2])
    assert (tier.stats().objects, tier.stats().used_bytes) == (3, 3 * OBJ)
    assert harness.metrics.value("kvtier_used_bytes", tier=tier.name) == 3 * OBJ
    assert harness.metrics.value("kvtier_capacity_bytes", tier=tier.name) == CAP


def test_hit_and_miss_metrics_count_what_was_served(tier, harness):
    c = make_chunks(5)
    tier.store(c.objs[:2] + c.objs[3:])
    assert consume(tier, c.keys) == 2
    m = harness.metrics
    assert m.value("kvtier_hit_chunks_total", tier=tier.name) == 2
    assert m.value("kvtier_hit_tokens_total", tier=tier.name) == sum(k.num_tokens for k in c.keys[:2])
    assert m.value("kvtier_miss_chunks_total", tier=tier.name) == 3


# ---------------------------------------------------------------- capacity


def test_capacity_is_never_exceeded_and_lru_keeps_the_most_recent(harness):
    cap = 4 * OBJ
    tier = harness.open(cap)
    heard = Heard(tier)
    c = make_chunks(10)
    for obj in c.objs:
        tier.store([obj])
        harness.settle(tier)
        assert tier.stats().used_bytes <= cap
        harness.tick()
    kept = present(tier, c.keys)
    assert kept, "the most recent object was evicted"
    assert kept == list(range(10 - len(kept), 10)), "eviction did not follow recency"
    assert heard.digests == {k.digest for i, k in enumerate(c.keys) if i not in kept}, "a listener missed evictions"
    assert tier.stats().objects == len(kept)
    assert tier.stats().used_bytes == len(kept) * OBJ


def test_a_batch_larger_than_capacity_keeps_its_tail(harness):
    cap = 4 * OBJ
    tier = harness.open(cap)
    c = make_chunks(10)
    tier.store(c.objs)
    harness.settle(tier)
    assert tier.stats().used_bytes <= cap
    kept = present(tier, c.keys)
    assert kept and kept[-1] == 9


def test_reading_an_object_makes_it_recent(harness):
    tier = harness.open(4 * OBJ)
    c = make_chunks(5)
    for obj in c.objs[:4]:
        tier.store([obj])
        harness.tick()
    assert consume(tier, c.keys[:1]) == 1
    harness.tick()
    tier.store([c.objs[4]])
    harness.settle(tier)
    kept = present(tier, c.keys)
    assert 0 in kept and 4 in kept and 1 not in kept


# ---------------------------------------------------------------- concurrency and close


def test_concurrent_readers_and_writers_see_whole_objects(tier):
    c = make_chunks(24)
    tier.store(c.objs[::2])  # half already there: stores race with skips
    stop = time.monotonic() + 0.5
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            i, rounds = offset, 0
            # At least 7 rounds (together they store every chunk), then more
            # until the time is up: a slow backend still gets the full check.
            while rounds < 7 or time.monotonic() < stop:
                rounds += 1
                lo = i % 21
                tier.store(c.objs[lo : lo + 4])
                n = 0
                for obj in tier.fetch(c.keys[lo : lo + 4]):
                    assert bytes(obj.payload) == payload_for(c.keys[lo + n])
                    n += 1
                assert n == 4  # nothing deletes or evicts here
                bufs = [bytearray(len(payload_for(k))) for k in c.keys[lo : lo + 4]]
                assert tier.load(c.keys[lo : lo + 4], bufs) == 4
                assert [bytes(b) for b in bufs] == [payload_for(k) for k in c.keys[lo : lo + 4]]
                i += 3
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert present(tier, c.keys) == list(range(24))


def _threads_of(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"kvtier-{name}-")]


def test_close_is_idempotent_joins_threads_and_keeps_persistent_data(harness):
    tier = harness.open()
    c = make_chunks(3)
    tier.store(c.objs)
    assert consume(tier, c.keys) == 3
    tier.close()
    tier.close()
    assert _threads_of(harness.name) == []
    again = harness.open()
    expect = 3 if tier.persistent else 0
    assert again.lookup(c.keys) == expect
    assert consume(again, c.keys) == expect


def test_tier_is_a_context_manager(harness):
    c = make_chunks(2)
    with harness.open() as tier:
        tier.store(c.objs)
    assert _threads_of(harness.name) == []
