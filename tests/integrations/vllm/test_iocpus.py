"""Where a worker's kvtier threads run (iocpus.py)."""

from __future__ import annotations

import os

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.iocpus import io_thread_cpus, parse_io_cpus


@pytest.mark.parametrize("value, expect", [
    ("auto", "auto"), ("Inherit", "inherit"), ("0", frozenset({0})), ([0], frozenset({0})), ("0-0", frozenset({0})),
])
def test_io_cpus_setting(value, expect):
    assert parse_io_cpus(value) == expect


@pytest.mark.parametrize("value", ["", "fast", "3-1", "-1", "0,x", [None], "100000"])
def test_a_bad_io_cpus_setting_names_the_key_and_the_fix(value):
    with pytest.raises(ConfigError, match="io_cpus.*(write|name CPUs)"):
        parse_io_cpus(value)


def test_io_threads_leave_the_engines_pin_on_the_cpu_backend_only():
    engine = frozenset(os.sched_getaffinity(os.getppid()))
    assert io_thread_cpus("auto", kv_on_cpu=True) == engine
    assert io_thread_cpus("auto", kv_on_cpu=False) is None  # a GPU worker keeps its NUMA binding
    assert io_thread_cpus("inherit", kv_on_cpu=True) is None
    assert io_thread_cpus(frozenset({0}), kv_on_cpu=False) == {0}
