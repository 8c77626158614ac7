"""Where a worker's kvtier threads run (``io_cpus``).

On vLLM's CPU backend every thread of a worker is pinned to its OpenMP
cores, and threads inherit that pin: kvtier's loads, tier I/O and saves
would then share the engine's compute cores. ``io_cpus`` names where they
run instead; the worker applies it once it sees its KV tensors.

Threads: none of its own; pure functions of the setting and this process's
affinity.
"""

from __future__ import annotations

import os
from typing import Any

from kvtier.errors import ConfigError


def parse_io_cpus(value: Any) -> str | frozenset[int]:
    """``io_cpus``: where a worker's kvtier threads (loads, tier I/O, saves) run.

    - ``auto`` (default): on vLLM's CPU backend, which pins every thread of a
      worker to its OpenMP cores (threads inherit that pin), the CPUs of the
      engine process that started the worker; elsewhere as inherited (a GPU
      worker under ``numa_bind`` keeps its NUMA node).
    - ``inherit``: wherever the worker's thread that starts them runs.
    - CPU ids: ``"0-3,8"`` or ``[0, 1, 2, 3, 8]``.
    """
    if isinstance(value, str) and value.strip().lower() in ("auto", "inherit"):
        return value.strip().lower()
    fix = 'write "auto", "inherit", or CPU ids such as "0-3,8"'
    cpus: set[int] = set()
    try:
        parts = value if isinstance(value, (list, tuple)) else str(value).split(",")
        for part in parts:
            lo, _, hi = str(part).strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except (TypeError, ValueError):
        raise ConfigError("io_cpus", f"cannot read CPU ids from {value!r}", fix) from None
    if not cpus:
        raise ConfigError("io_cpus", "names no CPU", fix)
    if hasattr(os, "sched_getaffinity") and not cpus & _allowed_cpus():
        raise ConfigError("io_cpus", f"none of CPUs {cpu_list(cpus)} is available to this process",
                          f"name CPUs among {cpu_list(_allowed_cpus())}")
    return frozenset(cpus)


def _allowed_cpus() -> set[int]:
    """The CPUs this process's engine may use: its parent's (the engine
    process of a worker), else its own."""
    for pid in (os.getppid(), 0):
        try:
            return set(os.sched_getaffinity(pid))
        except OSError:
            continue
    return set(range(os.cpu_count() or 1))


def io_thread_cpus(setting: str | frozenset[int], kv_on_cpu: bool) -> frozenset[int] | None:
    """The CPUs for this worker's kvtier threads under ``setting``; None: as inherited."""
    if isinstance(setting, frozenset):
        return setting
    if setting == "auto" and kv_on_cpu and hasattr(os, "sched_getaffinity"):
        return frozenset(_allowed_cpus())
    return None


def cpu_list(cpus) -> str:
    return ",".join(map(str, sorted(cpus)))
