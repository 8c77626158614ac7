"""A slower drive on the same machine: the kernel's block-layer read throttle.

``kvtier bench resume --concurrency`` compares a shared tier with one local
drive per server. On one machine both live on the same device, so the local
drive is *modelled*: the engine process of that configuration (and every
process it starts) runs in a control group whose reads from the device are
held to a rate by the kernel's block throttle (cgroup v1
``blkio.throttle.read_bps_device``, cgroup v2 ``io.max rbps``). Everything
above the block layer is the same code on the same files: O_DIRECT, native
AIO, the same objects; only the device's rate differs, which is what sets a
local drive apart from an array in the reference measurements.

Needs root (or a delegated control group) and a directory on a block
device; ``why_not`` says what is missing.

Threads: the caller's only.
"""

from __future__ import annotations

import os
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/blkio")
_V2 = Path("/sys/fs/cgroup")


def block_device(path: Path) -> str:
    """``MAJ:MIN`` of the whole disk ``path`` lives on ("" if none: tmpfs,
    overlay and network file systems have no block device)."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return ""
    sysdev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sysdev.exists():
        return ""
    if (sysdev / "partition").exists():
        # The throttle applies to whole disks: the partition's parent.
        parent = sysdev.resolve().parent / "dev"
        return parent.read_text().strip() if parent.exists() else ""
    return f"{major}:{minor}"


def _version() -> int:
    if (_V1 / "blkio.throttle.read_bps_device").exists():
        return 1
    if "io" in (_V2 / "cgroup.controllers").read_text().split() if (_V2 / "cgroup.controllers").exists() else False:
        return 2
    return 0


def why_not(path: Path) -> str:
    """Why reads under ``path`` cannot be throttled here ("" if they can)."""
    if not block_device(path):
        return f"{path} is not on a block device (the kernel's throttle works on disks)"
    version = _version()
    if not version:
        return "the kernel's block-layer read throttle (cgroup blkio or io controller) is not available"
    parent = _V1 if version == 1 else _V2
    if not os.access(parent, os.W_OK):
        return f"no right to create a control group under {parent} (run as root)"
    return ""


class ReadThrottle:
    """A control group whose processes read ``path``'s disk at ``bps`` bytes
    per second at most, all together. ``join(pid)`` moves a process in (its
    children follow); ``close`` removes the group once its processes ended."""

    def __init__(self, path: Path, bps: float, name: str = ""):
        reason = why_not(path)
        if reason:
            raise RuntimeError(reason)
        self.device = block_device(path)
        self.bps = int(bps)
        self.version = _version()
        base = _V1 if self.version == 1 else _V2
        self.dir = base / (name or f"kvtier-bench-{os.getpid()}")
        self.dir.mkdir(exist_ok=True)
        if self.version == 1:
            (self.dir / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.bps}\n")
        else:
            (self.dir / "io.max").write_text(f"{self.device} rbps={self.bps}\n")

    def join(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(f"{pid}\n")

    def close(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass  # a process still in it: the group goes when the machine reboots

    def __enter__(self) -> "ReadThrottle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
