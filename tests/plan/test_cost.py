"""The prefill law's fit: non-negative, and no per-request term it cannot see."""
import pytest

from kvtier.plan.cost import PrefillModel, fit_prefill


def test_fit_recovers_a_law_over_a_wide_span():
    law = PrefillModel(2e-3, 3e-7, 0.05)
    samples = [(n, law.seconds(n)) for n in (512, 1024, 2048, 4096, 8192)]
    fit = fit_prefill(samples)
    assert fit.a == pytest.approx(law.a, rel=1e-6)
    assert fit.b == pytest.approx(law.b, rel=1e-6)
    assert fit.c == pytest.approx(law.c, rel=1e-6)


def test_narrow_span_holds_the_per_request_term():
    """A chat's prompts (600-1500 tokens) with a little noise: a free
    intercept fitted 1.25 s per request and no per-token cost at all."""
    law = PrefillModel(2.3e-3, 1e-7, 0.02)
    noise = [0.04, -0.05, 0.06, -0.03, 0.05, -0.06, 0.02, -0.04]
    ns = [585, 627, 747, 875, 933, 1145, 1260, 1528]
    fit = fit_prefill([(n, law.seconds(n) + e) for n, e in zip(ns, noise)])
    assert fit.c == pytest.approx(0.02)
    for n in (600, 1000, 1500):  # and it predicts the span it saw
        assert fit.seconds(n) == pytest.approx(law.seconds(n), rel=0.05)


def test_coefficients_never_go_negative():
    # Falling per-token cost (noise): the fit drops the term instead of
    # clipping it and keeping the others fitted for it.
    samples = [(512, 1.0), (1024, 1.9), (2048, 3.5), (4096, 6.4), (8192, 12.0)]
    fit = fit_prefill(samples)
    assert fit.b == 0 and fit.a > 0 and fit.c > 0  # the concave term is gone; a line through the points
    err = sum((fit.seconds(n) - s) ** 2 for n, s in samples)
    clipped = PrefillModel(max(fit.a, 0), 0.0, 0.0)  # any other non-negative law fits worse, e.g. no intercept
    assert err < sum((clipped.seconds(n) - s) ** 2 for n, s in samples)


def test_cached_context_samples_identify_the_per_request_term():
    """A chat's whole prompts alone span too little to see c; with the
    engine-prefix-cache requests (short suffixes against long contexts) the
    computed lengths span enough, and the fit finds the law."""
    law = PrefillModel(2e-3, 2e-7, 0.09)
    whole = [(n, law.seconds(n)) for n in (600, 800, 1000, 1300, 1500)]
    cached = [(n, h, law.seconds(n, h)) for n, h in ((800, 640), (1100, 1024), (1300, 1024), (1500, 1280))]
    fit = fit_prefill(whole + cached)
    assert fit.c == pytest.approx(law.c, rel=1e-3)
    assert fit.seconds(1200, 1024) == pytest.approx(law.seconds(1200, 1024), rel=1e-3)
