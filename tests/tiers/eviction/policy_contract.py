"""The eviction policy contract, one mixin run over every policy.

A policy joins by a test class that inherits ``PolicyContract`` and says
how to make it (``make(capacity)``). The mixin checks what every tier
relies on: bytes and keys counted, inserts of held keys, removals
idempotent, ``victims`` a prefix of the policy's own order that frees what
was asked (skipping what the tier may not evict) and changes nothing,
``to_free`` making room. What order a policy keeps is its own test's.
"""

from __future__ import annotations

import random

from kvtier.tiers.eviction import EvictionPolicy


def prefix_freeing(order: list, sizes: dict, need: int) -> list:
    """The shortest prefix of ``order`` whose sizes reach ``need`` (all of it if they fall short)."""
    out, freed = [], 0
    for k in order:
        if freed >= need:
            break
        out.append(k)
        freed += sizes[k]
    return out


class PolicyContract:
    capacity = 1000

    def make(self, capacity: int) -> EvictionPolicy:
        raise NotImplementedError

    def filled(self, sizes: dict) -> EvictionPolicy:
        p = self.make(self.capacity)
        for k, s in sizes.items():
            p.insert(k, s)
        return p

    # ------------------------------------------------------------ empty
    def test_an_empty_policy_holds_nothing_and_offers_no_victims(self):
        p = self.make(self.capacity)
        assert (len(p), p.used, list(p)) == (0, 0, [])
        assert "a" not in p
        assert p.victims(10) == []
        assert p.touch("a") is False
        assert p.remove("a") is None
        assert p.get("a") is None and p.get("a", 7) == 7
        assert (len(p), p.used) == (0, 0)

    # ------------------------------------------------------------ insert, remove
    def test_inserts_count_keys_and_bytes_and_keep_values(self):
        p = self.make(self.capacity)
        p.insert("a", 10, "va")
        p.insert("b", 20)
        assert (len(p), p.used) == (2, 30)
        assert "a" in p and "b" in p
        assert (p.size("a"), p.get("a"), p.get("b")) == (10, "va", None)
        assert sorted(p) == ["a", "b"]

    def test_an_insert_of_a_held_key_replaces_its_size_and_value(self):
        p = self.filled({"a": 10, "b": 20})
        p.insert("a", 15, "new")
        assert (len(p), p.used, p.size("a"), p.get("a")) == (2, 35, 15, "new")
        assert sorted(p) == ["a", "b"]

    def test_remove_returns_the_bytes_once(self):
        p = self.filled({"a": 10, "b": 20})
        assert p.remove("a") == 10
        assert p.remove("a") is None
        assert (len(p), p.used, list(p)) == (1, 20, ["b"])
        p.insert("a", 5)  # back, as new
        assert (len(p), p.used, sorted(p)) == (2, 25, ["a", "b"])

    def test_clear_empties_it(self):
        p = self.filled({"a": 10, "b": 20})
        p.clear()
        assert (len(p), p.used, list(p)) == (0, 0, [])
        assert p.victims(1) == []

    def test_touch_keeps_keys_and_bytes_and_does_not_bring_a_key_forward(self):
        p = self.filled({k: 10 for k in "abcde"})
        for k in "cac":
            before = list(p).index(k)
            assert p.touch(k) is True
            assert list(p).index(k) >= before
        assert (len(p), p.used, sorted(p)) == (5, 50, list("abcde"))

    # ------------------------------------------------------------ victims
    def test_victims_are_the_prefix_of_the_order_that_frees_what_is_asked(self):
        sizes = {"a": 10, "b": 30, "c": 20, "d": 40}
        p = self.filled(sizes)
        p.touch("b")
        order = list(p)
        for need in (1, 10, 11, 40, 41, 99, 100):
            got = p.victims(need)
            assert got == prefix_freeing(order, sizes, need), need
            assert sum(sizes[k] for k in got) >= need
        assert list(p) == order and p.used == 100  # asking changes nothing

    def test_victims_of_more_than_is_held_are_every_key_and_of_nothing_none(self):
        p = self.filled({"a": 10, "b": 20})
        assert sorted(p.victims(1000)) == ["a", "b"]
        assert p.victims(0) == [] and p.victims(-5) == []

    def test_victims_skip_what_may_not_be_evicted(self):
        sizes = {k: 10 for k in "abcdef"}
        p = self.filled(sizes)
        order = list(p)
        pinned = {order[0], order[2]}
        got = p.victims(25, lambda k: k not in pinned)
        assert got == [k for k in order if k not in pinned][:3]
        assert p.victims(1000, lambda k: False) == []

    # ------------------------------------------------------------ to_free
    def test_to_free_makes_room_grows_with_usage_and_says_when_usage_is_over(self):
        p = self.make(self.capacity)
        assert p.to_free(0) == 0 and not p.over(0)
        last = 0
        for used in range(0, 2 * self.capacity + 1, 7):
            for incoming in (0, 1, 50, self.capacity):
                free = p.to_free(used, incoming)
                assert free >= 0
                assert used - free + incoming <= self.capacity or free == used, (used, incoming)
            assert p.over(used) is (p.to_free(used) > 0)
            assert p.to_free(used) >= last
            last = p.to_free(used)
        assert p.over(self.capacity + 1)

    # ------------------------------------------------------------ bookkeeping under load
    def test_random_operations_keep_keys_and_bytes_consistent(self):
        rng = random.Random(3)
        p = self.make(self.capacity)
        model: dict[int, int] = {}
        for _ in range(3000):
            k = rng.randrange(60)
            op = rng.random()
            if op < 0.45:
                s = rng.randrange(1, 50)
                p.insert(k, s, ("v", k))
                model[k] = s
            elif op < 0.75:
                assert p.touch(k) is (k in model)
            elif op < 0.9:
                assert p.remove(k) == model.pop(k, None)
            else:
                need = rng.randrange(0, 300)
                got = p.victims(need)
                assert got == prefix_freeing(list(p), model, need)
                for v in got:
                    assert p.remove(v) == model.pop(v)
            assert p.used == sum(model.values())
            assert len(p) == len(model)
            order = list(p)
            assert sorted(order) == sorted(model) and len(set(order)) == len(order)
            assert all(p.get(k) == ("v", k) for k in model)
