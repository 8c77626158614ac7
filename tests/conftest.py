"""Shared fixtures; helpers and the test geometry live in ``tests/support.py``."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from kvtier import auth
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


@pytest.fixture
def key_file(tmp_path) -> str:
    """A cluster key file with one new key (kvtier/auth.py)."""
    path = str(tmp_path / "cluster.key")
    auth.write_key_file(path, [auth.new_key()])
    return path


@pytest.fixture
def node_dir():
    """A node memory tier's folder on tmpfs, removed afterwards."""
    path = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)
