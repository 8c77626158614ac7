"""Fixtures of the planner's tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtier.cli import main


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def kvtier(capsys):
    """``kvtier(*argv)``: the command in this process, its exit status and output."""
    def run(*args) -> Result:
        try:
            rc = main(list(args))
        except SystemExit as exc:  # argparse: --help, usage errors
            rc = exc.code
        out = capsys.readouterr()
        return Result(rc, out.out, out.err)

    return run
