"""Shared fixtures; helpers and the test geometry live in ``tests/support.py``."""

from __future__ import annotations

import pytest

from kvtier.metrics import Metrics
from tests.support import WriteGate


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def write_gate(monkeypatch):
    gate = WriteGate(monkeypatch)
    yield gate
    gate.open()  # never leave a writer stuck
