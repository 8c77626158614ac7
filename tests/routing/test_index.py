"""The prefix index fed through vLLM's own publisher: exact predictions per
instance, removal, tenants' salts, media, shared tiers."""

from __future__ import annotations

from kvtier.routing.index import CLASSES, Holding
from tests.routing.support import BS, cleared, prompt, removed, stored

CPU = dict(medium="CPU", locality="LOCAL", ownership="memory")
DISK = dict(medium="STORAGE", locality="LOCAL", ownership="disk")
SHARED = dict(medium="STORAGE", locality="REMOTE", ownership="shared")


def send(engines, er, k, *events):
    engines[k].send(er.subscribers[k], *events)


def hits(er, tokens, salt=None):
    return [p.tokens for p in er.index.predict(tokens, salt)]


def test_each_instance_gets_the_prefix_its_blocks_match(cluster):
    es, er = cluster(3)
    p = prompt(1, 3)
    # Each engine hashes with a seed of its own: the index matches by content.
    send(es, er, 0, stored([11, 12, 13], None, p[:3 * BS]))
    send(es, er, 1, stored([b"x1"], None, p[:BS]))
    q = prompt(2, 3)
    send(es, er, 2, stored([31, 32], None, q[:2 * BS]))
    assert hits(er, p) == [48, 16, 0]
    assert hits(er, p[:2 * BS] + [7] * BS) == [32, 16, 0]   # diverges in the third block
    assert hits(er, p[:BS + 5]) == [16, 16, 0]               # whole blocks only
    # A later event continues a chain through its parent's hash.
    send(es, er, 2, stored([33], 32, q[2 * BS:3 * BS]))
    assert hits(er, q) == [0, 0, 48]
    # A block whose parent the index never saw is not reachable from a prompt's start.
    send(es, er, 1, stored([b"y2"], b"unknown", p[BS:2 * BS]))
    assert hits(er, p)[1] == 16
    seg = er.index.predict(p)[0].segments
    assert [(s.start, s.end, s.holding, s.source) for s in seg] == [
        (0, 16, Holding("GPU", "LOCAL", None), 0), (16, 32, Holding("GPU", "LOCAL", None), 0),
        (32, 48, Holding("GPU", "LOCAL", None), 0)]


def test_removal_takes_one_holding_and_a_reset_only_the_gpus(cluster):
    es, er = cluster(1)
    p = prompt(1, 3)
    send(es, er, 0, stored([1, 2, 3], None, p[:48]), stored([1, 2, 3], None, p[:48], **CPU))
    assert er.index.predict(p)[0].by_class() == (48, 0, 0, 0)
    send(es, er, 0, removed([2]))                  # vLLM evicted block 2 from its GPU
    assert er.index.predict(p)[0].by_class() == (32, 16, 0, 0)
    send(es, er, 0, removed([2], **CPU))           # and kvtier's memory tier dropped it
    assert hits(er, p) == [16]                     # block 3 is held, but behind a hole
    send(es, er, 0, stored([2], 1, p[16:32], **DISK))
    assert er.index.predict(p)[0].by_class() == (32, 0, 16, 0)
    send(es, er, 0, cleared())                     # vLLM reset its prefix cache
    assert er.index.predict(p)[0].by_class() == (0, 32, 16, 0)
    send(es, er, 0, removed([1, 3], medium="CPU"), removed([2], medium="STORAGE", ownership="disk"))
    assert hits(er, p) == [0] and er.index.blocks(0) == 0


def test_a_removal_names_its_tier(cluster):
    es, er = cluster(1)
    p = prompt(1, 1)
    send(es, er, 0, stored([1], None, p[:16], **DISK), stored([1], None, p[:16], **SHARED))
    send(es, er, 0, removed([1], medium="STORAGE", ownership="shared"))
    assert er.index.predict(p)[0].by_class() == (0, 0, 16, 0)
    send(es, er, 0, removed([1], medium="GPU"))    # not held on the GPU: nothing changes
    assert hits(er, p) == [16]


def test_salts_keep_tenants_apart(cluster):
    es, er = cluster(3)
    p = prompt(1, 3)
    send(es, er, 0, stored([1, 2, 3], None, p[:48], extra=[("tenant-a",), None, None]))
    send(es, er, 1, stored([1, 2, 3], None, p[:48]))
    send(es, er, 2, stored([4, 5, 6], None, p[:48], extra=[("tenant-b",), None, None]))
    assert hits(er, p, "tenant-a") == [48, 0, 0]
    assert hits(er, p) == [0, 48, 0]
    assert hits(er, p, "tenant-b") == [0, 0, 48]
    assert hits(er, p, "tenant-c") == [0, 0, 0]
    assert er.choose(p, "tenant-a").instance == 0 and er.choose(p, "tenant-b").instance == 2


def test_a_shared_tier_serves_every_instance_that_reads_it(cluster):
    es, er = cluster(3)
    p = prompt(1, 3)
    send(es, er, 0, stored([1, 2, 3], None, p[:48], **SHARED))
    send(es, er, 1, stored([7], None, p[:16]))  # instance 1 has the first block on its GPU
    assert hits(er, p) == [48, 48, 48]
    (mine, mixed, other) = er.index.predict(p)
    assert mixed.by_class() == (16, 0, 0, 32) and [s.source for s in mixed.segments] == [1, 0, 0]
    assert other.by_class() == (0, 0, 0, 48)
    assert er.choose(p).instance == 1   # as long a hit, part of it on a GPU
    # Local holdings stay with their instance.
    q = prompt(2, 2)
    send(es, er, 0, stored([21, 22], None, q[:32], **DISK))
    assert hits(er, q) == [32, 0, 0]


def test_a_block_gone_from_a_shared_tier_is_gone_for_every_reader(cluster):
    """The shared tier's collector may run on any node: its removal is
    reported by an instance other than the one that reported the store."""
    es, er = cluster(3, shared=[{0, 1}, {2}])
    p = prompt(1, 2)
    send(es, er, 0, stored([1, 2], None, p[:32], **SHARED))
    send(es, er, 2, stored([1, 2], None, p[:32], **SHARED))  # another tier of the same name, read by 2 only
    send(es, er, 1, removed([2], **SHARED))
    assert hits(er, p) == [16, 16, 32]


def test_only_the_instances_of_a_tiers_group_read_it(cluster):
    es, er = cluster(3, shared=[{0, 1}])
    p = prompt(1, 2)
    send(es, er, 0, stored([1, 2], None, p[:32], **SHARED))
    assert hits(er, p) == [32, 32, 0]


def test_events_it_cannot_use_are_counted(cluster):
    es, er = cluster(1)
    p = prompt(1, 2)
    other_group = stored([1], None, p[:16])
    other_group.group_idx = 1
    bad = stored([1, 2], None, p[:20])  # 20 tokens do not cut into two blocks of 16
    send(es, er, 0, other_group, bad)
    assert hits(er, p) == [0]
    (st,) = er.stats()
    assert st["ignored_events"] == 1 and st["malformed_events"] == 1 and st["events"] == 2


def test_classes_rank_fastest_first():
    ranks = [Holding(*h).speed for h in
             [("GPU", "LOCAL", None), ("CPU", "LOCAL", "memory"), ("STORAGE", "LOCAL", "disk"),
              ("STORAGE", "REMOTE", "shared"), ("CPU", "REMOTE", "x"), ("TAPE", "LOCAL", "y")]]
    assert ranks == [0, 1, 2, 3, 3, 3] and len(CLASSES) == 4
