"""Value types of the commands' arguments (``type=`` of argparse), shared by
every command module: a bad value is argparse's usage error (exit status 2)
with the reason."""

from __future__ import annotations

import argparse

from kvtier.config import parse_size
from kvtier.errors import ConfigError


def size(text: str) -> int:
    """Bytes: ``2GiB``, ``512MiB``, ``10GB``, ``4096B``; a number without
    its unit is refused (argparse names the flag)."""
    try:
        return parse_size(text, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{exc.problem}; {exc.fix}") from None


def sizes(text: str) -> tuple[int, ...]:
    """Comma-separated sizes: ``16MiB,64MiB``."""
    return tuple(size(t) for t in text.split(",") if t)


def ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers: ``1,8,32``."""
    try:
        return tuple(int(t) for t in text.split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_floats(text: str) -> tuple[float, ...]:
    """Comma-separated positive numbers, returned ascending without
    repeats: ``0.25,0.5,1,2``."""
    try:
        values = tuple(float(t) for t in text.split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, comma-separated, got {text!r}")
    return tuple(sorted(set(values)))


def seconds(text: str) -> float:
    """A positive duration in seconds: ``2``, ``2s``, ``500ms``."""
    t = text.strip().lower()
    scale = 1e-3 if t.endswith("ms") else 1.0
    t = t.removesuffix("ms").removesuffix("s")
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration such as 2s or 500ms, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive duration, got {text!r}")
    return value


def pair(text: str) -> tuple[int, int]:
    """Two integers, ``LO,HI``."""
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
    return a, b


def words(text: str) -> list[str]:
    """Comma-separated names, empty ones dropped."""
    return [t for t in text.split(",") if t]


def ratio(text: str) -> float:
    """A positive ratio: ``0.66`` or ``A:B`` (``6.78:10.3``)."""
    try:
        a, _, b = text.partition(":")
        value = float(a) / float(b) if b else float(a)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a ratio such as 0.66 or 6.78:10.3, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive ratio, got {text!r}")
    return value
