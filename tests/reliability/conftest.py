"""Fixtures of the reliability suite.

``harness`` runs a test against every tier kind of the contract suite
(memory, disk, shared, and redis/s3 against real servers where installed).
``small_fs`` mounts a tmpfs of a given size (we run as root in CI; without
the right to mount, the tests that need a full file system are skipped and
say why).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.tiers.harness import HARNESSES


def pytest_sessionfinish(session, exitstatus):
    from tests.tiers import s3server

    s3server.shutdown()


@pytest.fixture(params=sorted(HARNESSES))
def harness(request, tmp_path, metrics):
    h = HARNESSES[request.param](tmp_path, metrics)
    yield h
    h.close_all()


class SmallFs:
    """tmpfs file systems mounted by one test, unmounted at its end."""

    def __init__(self, root: Path):
        self.root = root
        self.mounted: list[Path] = []

    def mount(self, name: str, size: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): needs root")
        self.mounted.append(path)
        return path

    def bind(self, src: Path, name: str) -> Path:
        """``src`` also visible at ``root/name`` (a bind mount): detaching it
        later takes the data away from kvtier without destroying it."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "--bind", str(src), str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot bind-mount here ({proc.stderr.strip() or proc.returncode}): needs root")
        self.mounted.append(path)
        return path

    def detach(self, path: Path) -> None:
        subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True)
        self.mounted.remove(path)

    def unmount_all(self) -> None:
        for path in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        self.mounted.clear()


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    fs = SmallFs(tmp_path / "mnt")
    yield fs
    fs.unmount_all()
