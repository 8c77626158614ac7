"""Run Debian's ``fio`` to measure what the storage under a directory can do.

This is the limit kvtier's own reads are compared with, in the same run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


# Streams of the buffered job the benchmarks run: kvtier's file tiers read
# with 16 I/O threads by default, many objects at once.
BUFFERED_STREAMS = 16


# fio's buffers on huge pages (``--iomem=shmhuge``: System V shared memory
# with SHM_HUGETLB, from the kernel's reserved pool, ``vm.nr_hugepages``).
# kvtier reads into buffers on transparent huge pages; fio's default buffers
# are malloc'd, on 4 KiB pages where transparent huge pages are "madvise".
# An O_DIRECT read pins every page of its buffer: on 4 KiB pages fio reads
# slower and spends more CPU than on huge pages (docs/benchmarks.md).
HUGE_PAGE_SIZE = 2 << 20
MEMINFO = "/proc/meminfo"


class FioMissing(RuntimeError):
    pass


def huge_pages_free(meminfo: str = MEMINFO) -> int:
    """Bytes of reserved huge pages free now (``HugePages_Free`` times
    ``Hugepagesize``), 0 where there are none or no such file."""
    free = size_kib = 0
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("HugePages_Free:"):
                    free = int(line.split()[1])
                elif line.startswith("Hugepagesize:"):
                    size_kib = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return free * size_kib * 1024


def huge_buffer_bytes(iodepth: int, block: str) -> int:
    """What one fio job's buffers take on huge pages: ``iodepth`` blocks,
    rounded up to whole huge pages (with one page to spare for alignment)."""
    n = _block_bytes(block) * iodepth
    return (-(-n // HUGE_PAGE_SIZE) + 1) * HUGE_PAGE_SIZE


def huge_pages_short(depths, block: str = "1M") -> str:
    """Why fio's O_DIRECT jobs at ``depths`` cannot run with their buffers
    on huge pages here, or "" where they can: enough reserved huge pages
    free for the deepest (the jobs run one at a time)."""
    need = max((huge_buffer_bytes(d, block) for d in depths), default=0)
    free = huge_pages_free()
    if free >= need:
        return ""
    return (f"{free >> 20} MiB of reserved huge pages free, {need >> 20} MiB needed: "
            f"sysctl vm.nr_hugepages={need // HUGE_PAGE_SIZE} (as root) adds them")


def _block_bytes(block: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    b = block.strip().lower()
    return int(b[:-1]) * units[b[-1]] if b[-1] in units else int(b)


@dataclass(frozen=True)
class FioRead:
    """One fio run: bandwidth in GB/s (10^9 bytes/s), bytes read, and the CPU
    seconds (user + system) its jobs spent, from fio's own accounting
    (``usr_cpu``/``sys_cpu`` are percentages of ``job_runtime``, both summed
    over the jobs of a group)."""

    gbps: float
    nbytes: int
    cpu_s: float

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / 1e9) if self.nbytes else float("nan")


def fio_seq_read(directory: Path, iodepth: int, size_bytes: int, block: str = "1M", direct: bool = True,
                 jobs: int = 1) -> float:
    """Sequential read bandwidth in GB/s (10^9 bytes/s): ``fio_seq_read_run``'s."""
    return fio_seq_read_run(directory, iodepth, size_bytes, block, direct, jobs).gbps


def fio_seq_read_run(directory: Path, iodepth: int, size_bytes: int, block: str = "1M", direct: bool = True,
                     jobs: int = 1, file_bytes: int = 0, huge_pages: bool = False) -> FioRead:
    """Sequential reads of one fio job, or of ``jobs`` streams at once, each
    reading a file of its own (``size_bytes`` in all), as kvtier's I/O
    threads read many objects at once.

    ``file_bytes``: each stream instead reads its share as files of this size,
    one after the other (kvtier's object size): what the device gives a
    layout of one file per object, with no kvtier code in the way.
    ``huge_pages``: fio's buffers on reserved huge pages (``HUGE_PAGE_SIZE``;
    ``huge_buffer_bytes`` of them must be free, ``huge_pages_free``)."""
    exe = _fio()
    directory.mkdir(parents=True, exist_ok=True)
    per_job = max(1 << 20, size_bytes // jobs)
    files: list[str] = []
    if file_bytes:
        nfiles = max(1, per_job // file_bytes)
        files = [f"--nrfiles={nfiles}", f"--filesize={file_bytes}", "--file_service_type=sequential"]
        per_job = nfiles * file_bytes
    cmd = [
        exe,
        f"--name={'kvtier-objread' if file_bytes else 'kvtier-seqread'}",
        f"--directory={directory}",
        *(["--filename=kvtier-fio.dat"] if jobs == 1 and not file_bytes else [f"--numjobs={jobs}", "--group_reporting"]),
        *files,
        "--rw=read",
        f"--bs={block}",
        f"--direct={1 if direct else 0}",
        "--ioengine=libaio",
        f"--iodepth={iodepth}",
        *(["--iomem=shmhuge", f"--hugepage-size={HUGE_PAGE_SIZE}"] if huge_pages else []),
        f"--size={per_job}",
        "--invalidate=1",
        "--output-format=json",
    ]
    # Lay the files out first and let them reach the disk: fio's own
    # invalidation cannot drop pages still dirty from its lay-out, and a
    # buffered job would then read its own writes from memory.
    out = subprocess.run(cmd + ["--create_only=1"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[:500]}")
    os.sync()
    return _measured(cmd)


def fio_files_read(root: Path, block_bytes: int, iodepth: int, huge_pages: bool = False) -> FioRead:
    """O_DIRECT reads of every file below ``root`` as it lies, nothing laid
    out or written: kvtier's own object files, in requests of
    ``block_bytes`` (the object size: one request per object, as kvtier
    reads them), ``iodepth`` at once. The device's rate for the very bytes a
    cold load reads, where the file system put them, with no kvtier code in
    the way: on a disk whose speed differs by region, fio's own freshly
    laid-out files may lie elsewhere (docs/benchmarks.md)."""
    cmd = [
        _fio(),
        "--name=kvtier-objects",
        f"--opendir={root}",
        "--file_service_type=sequential",
        "--rw=read",
        f"--bs={block_bytes}",
        "--direct=1",
        "--ioengine=libaio",
        f"--iodepth={iodepth}",
        *(["--iomem=shmhuge", f"--hugepage-size={HUGE_PAGE_SIZE}"] if huge_pages else []),
        "--output-format=json",
    ]
    return _measured(cmd)


def _fio() -> str:
    exe = shutil.which("fio")
    if exe is None:
        raise FioMissing("fio is not installed: apt-get install fio (make demo/test install it)")
    return exe


def _measured(cmd: list[str]) -> FioRead:
    """Run one fio read job; its rate, bytes and CPU."""
    before = _children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    whole_run_cpu_s = _children_cpu_s() - before
    if out.returncode != 0:
        raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[:500]}")
    # fio may print warnings (and opendir's count of files) before the JSON document.
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    job = doc["jobs"][0]
    read = job["read"]
    runtime_ms = job.get("job_runtime") or read["runtime"]
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * runtime_ms / 1e3
    if cpu_s <= 0:
        # fio rounds each job's share to 0.01 % of its runtime: jobs of a few
        # MiB report none. Then count the whole fio run (its start-up too),
        # as the kernel accounted it to this process's children.
        cpu_s = whole_run_cpu_s
    return FioRead(read["bw_bytes"] / 1e9, int(read["io_bytes"]), cpu_s)


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def remove_fio_file(directory: Path) -> None:
    """Remove what ``fio_seq_read`` laid out under ``directory``."""
    (directory / "kvtier-fio.dat").unlink(missing_ok=True)
    for pattern in ("kvtier-seqread.*", "kvtier-objread.*"):
        for p in directory.glob(pattern):
            p.unlink(missing_ok=True)
