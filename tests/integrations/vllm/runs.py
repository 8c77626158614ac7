"""A test module's engine runs, declared as data and started ahead.

A module declares ``RUNS: dict[str, RunDef]`` (each run's spec, the runs it
needs first, hooks around it, how many CPUs and which environment it takes)
and marks each test with the runs it reads (``runs_marker``); its ``runs``
fixture (``start_runs``) starts every marked run, and what they need, as
soon as the module's first test asks, a few at a time (``EnginePool``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from tests.integrations.vllm.conftest import EngineRun


@dataclass
class Ctx:
    models: dict[str, Path]
    root: Path
    notes: dict[str, Any] = field(default_factory=dict)  # what hooks did, for the tests
    logs: dict[str, Path] = field(default_factory=dict)  # log of each finished run, for later hooks

    def dir(self, name: str) -> Path:
        return self.root / name


@dataclass(frozen=True)
class RunDef:
    spec: Callable[[Ctx], dict]
    deps: tuple[str, ...] = ()
    before: Callable[[Ctx], None] | None = None  # after deps, before the engine starts
    after: Callable[[Ctx], None] | None = None  # after the engine succeeded
    expect_failure: bool = False
    cpus: int = 1  # a tensor-parallel run takes one per rank
    # e.g. VLLM_ENABLE_V1_MULTIPROCESSING; or a function of the context (paths made there)
    env: dict[str, str] | Callable[[Ctx], dict[str, str]] = field(default_factory=dict)


class Runs:
    """Futures of a module's engine runs, started on creation."""

    def __init__(self, defs: dict[str, RunDef], pool, ctx: Ctx, wanted: set[str]):
        self.defs, self.pool, self.ctx = defs, pool, ctx
        self._futures: dict = {}
        for name in defs:  # declaration order is the start order
            if name in self._closure(wanted):
                self._start(name)

    def _closure(self, names: set[str]) -> set[str]:
        out: set[str] = set()
        todo = list(names)
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo.extend(self.defs[n].deps)
        return out

    def _start(self, name: str):
        if name not in self._futures:
            for dep in self.defs[name].deps:
                self._start(dep)
            self._futures[name] = self.pool.submit(self._task, name)
        return self._futures[name]

    def _task(self, name: str) -> "EngineRun":
        d = self.defs[name]
        for dep in d.deps:
            try:
                self._futures[dep].result()
            except Exception as exc:
                raise AssertionError(f"engine run {name!r} needs {dep!r}, which failed:\n{exc}") from None
        if d.before:
            d.before(self.ctx)
        env = d.env(self.ctx) if callable(d.env) else d.env
        run = self.pool.run(d.spec(self.ctx), name, cpus=d.cpus, env=env, expect_failure=d.expect_failure)
        self.ctx.logs[name] = run.log_path
        if d.after:
            d.after(self.ctx)
        return run

    def __getitem__(self, name: str) -> "EngineRun":
        return self._start(name).result()


def runs_marker(defs: dict[str, RunDef], *names: str):
    unknown = set(names) - set(defs)
    assert not unknown, unknown
    return pytest.mark.engine_runs(*names)


def start_runs(defs: dict[str, RunDef], request, engine_pool, tiny_models, tmp_path_factory) -> Runs:
    wanted: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            for mark in item.iter_markers("engine_runs"):
                wanted.update(mark.args)
    return Runs(defs, engine_pool, Ctx(tiny_models, tmp_path_factory.mktemp("tiers")), wanted)
