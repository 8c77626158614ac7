"""Fixtures of the directory tiers' tests."""

from __future__ import annotations

import pytest

from kvtier import observe
from kvtier.bench.readtrace import ReadTraces


@pytest.fixture
def read_traces():
    """The benchmark's read recorder, installed for the test:
    ``read_traces.watch(tier)`` is the ``ReadTrace`` of that tier's loads
    that start from then on."""
    with observe.installed(ReadTraces()) as traces:
        yield traces
