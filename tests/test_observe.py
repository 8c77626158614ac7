"""``kvtier.observe``: the read path's one hook for benchmarks."""

from __future__ import annotations

from kvtier import observe


class _Listening(observe.Observer):
    active = True


def test_nothing_listens_by_default_and_an_installed_observer_is_undone_after_its_block():
    tier = object()
    default = observe.observer
    assert not default.active and observe.observed(tier) is None
    with observe.installed(_Listening()) as mine:
        assert observe.observer is mine and observe.observed(tier) is mine
    assert observe.observer is default and observe.observed(tier) is None


def test_an_active_observer_that_does_not_watch_a_tier_is_not_told_of_it():
    class OnlyOne(_Listening):
        def __init__(self, tier):
            self.tier = tier

        def watches(self, source):
            return source is self.tier

    a, b = object(), object()
    with observe.installed(OnlyOne(a)) as mine:
        assert observe.observed(a) is mine and observe.observed(b) is None
