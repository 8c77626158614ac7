"""Progress reporting for the commands, in one place.

A *progress factory* is what long-running work takes from its command:
``make(desc, total)`` starts one task and returns ``tick(n)``, which the work
calls as it advances ``n`` units. The work never knows whether a bar is drawn
(``kvtier bench storage``, ``kvtier bench resume``, ``kvtier store verify``,
``kvtier plan``: ``--no-progress`` turns it off).
"""

from __future__ import annotations

import sys
from typing import Callable

Tick = Callable[[int], None]
Progress = Callable[[str, int], Tick]


def silent(desc: str, total: int) -> Tick:
    """The factory of work run without bars (tests, ``--no-progress``)."""
    return lambda n: None


def bars(enabled: bool = True) -> Progress:
    """tqdm bars on stderr, one per task, closed when their total is reached;
    without tqdm a line per 10%; ``silent`` when not ``enabled``."""
    if not enabled:
        return silent
    try:
        from tqdm import tqdm
    except ImportError:
        return _lines

    def make(desc: str, total: int) -> Tick:
        bar = tqdm(total=total, desc=desc, unit="", leave=False, file=sys.stderr, dynamic_ncols=True)

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= bar.total:
                bar.close()

        return tick

    return make


def _lines(desc: str, total: int) -> Tick:
    state = {"n": 0, "shown": -1}

    def tick(n: int) -> None:
        state["n"] += n
        if total:
            pct = 100 * state["n"] // total
            if pct // 10 > state["shown"]:
                state["shown"] = pct // 10
                print(f"{desc}: {pct}%", file=sys.stderr)

    return tick
