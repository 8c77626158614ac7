"""The router's choice: longest hit, then the faster medium, then the least
busy instance, then a seeded draw."""

from __future__ import annotations

from kvtier.routing.index import Holding, Prediction, PrefixIndex, Segment
from kvtier.routing.router import Router, score
from tests.routing.support import prompt, removed, stored

CPU = dict(medium="CPU", locality="LOCAL", ownership="memory")
DISK = dict(medium="STORAGE", locality="LOCAL", ownership="disk")
SHARED = dict(medium="STORAGE", locality="REMOTE", ownership="shared")


def test_the_longest_hit_wins_then_the_faster_medium(cluster):
    es, er = cluster(3)
    p = prompt(1, 3)
    send = lambda k, *ev: es[k].send(er.subscribers[k], *ev)  # noqa: E731
    send(0, stored([1, 2, 3], None, p[:48], **CPU))
    send(1, stored([1, 2], None, p[:32]))
    assert er.choose(p).instance == 0           # 48 tokens in host memory beat 32 on a GPU
    send(1, stored([3], 2, p[32:48]))
    assert er.choose(p).instance == 1           # 48 on a GPU beat 48 in host memory
    send(1, removed([1, 2, 3]), stored([1, 2, 3], None, p[:48], **DISK))
    assert er.choose(p).instance == 0           # host memory beats the local disk
    send(0, removed([1, 2, 3], medium="CPU"), stored([1, 2, 3], None, p[:48], **SHARED))
    choice = er.choose(p)
    assert choice.instance == 1                 # a local disk beats the shared tier every instance reads
    assert [x.tokens for x in choice.predictions] == [48, 48, 48]
    assert choice.score == (48, 0, 0, 48, 0, 0)


def test_equal_hits_go_to_the_least_busy_instance(cluster):
    es, er = cluster(2)
    p = prompt(1, 2)
    for k in (0, 1):
        es[k].send(er.subscribers[k], stored([1, 2], None, p[:32]))
    er.begin(0)
    assert er.choose(p).instance == 1
    er.begin(1)
    er.begin(1)
    assert er.choose(p).instance == 0
    er.end(1)
    er.end(1)
    er.end(0)
    assert er.router.in_flight() == [0, 0]


def test_ties_are_drawn_at_random_and_replayable():
    def picks(seed):
        r = Router(PrefixIndex(4), seed=seed)
        return [r.choose(prompt(s, 2)).instance for s in range(40)]

    assert picks(7) == picks(7)
    assert set(picks(7)) == {0, 1, 2, 3}
    assert picks(7) != picks(8)


def test_the_score_orders_length_then_media_then_load():
    gpu, cpu, remote = (Holding("GPU", "LOCAL", None), Holding("CPU", "LOCAL", "memory"),
                        Holding("STORAGE", "REMOTE", "shared"))
    on = lambda *hs: Prediction(16 * len(hs), tuple(Segment(16 * i, 16 * (i + 1), h, 0)  # noqa: E731
                                                    for i, h in enumerate(hs)))
    ranked = [on(gpu, gpu, gpu), on(remote, remote, remote), on(gpu, gpu), on(gpu, cpu), on(cpu, gpu),
              on(cpu, cpu), on(remote, remote)]
    scores = [score(p, 0) for p in ranked]
    assert scores[3] == scores[4]  # the same tokens per class, in any order
    assert scores == sorted(scores, reverse=True)
    assert score(on(gpu), 0) > score(on(gpu), 1) > score(on(), 0)
