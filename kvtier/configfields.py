"""Typed configuration keys: the kit every config dataclass is written with
(``opt``: a key with its default, its one-line doc and its range;
``size_field``: a size with its unit) and ``build``, which makes one from
loose values (a file, the environment, URL options) and names the key and
the fix of anything wrong (``ConfigError``). Sizes are read and written
here too (``parse_size``, ``fmt_bytes``).

It sits beneath both the tiers (each tier's config is such a dataclass)
and ``config`` (which finds tier kinds through the registry). ``config``
re-exports these names: a tier written outside kvtier may import them from
either.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import field
from typing import Any, Mapping

from kvtier.errors import ConfigError

MiB = 1 << 20
GiB = 1 << 30

# A number, then a unit: K, M, G, T, P with an optional "i" and/or "B"
# ("8G", "8Gi" and "8GiB" are binary, "8GB" decimal), or "B" alone (bytes).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i|ib|b)?|(b))\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE_FIX = "write a size with its unit, such as 8GiB, 512MiB, 10GB or 4096B"


def parse_size(value: Any, key: str) -> int:
    """Bytes from ``"512MiB"``, ``"8G"`` or ``"8GiB"`` (binary), ``"10GB"``
    (decimal) or ``"4096B"`` (bytes). A number without its unit is refused
    (``20`` could mean bytes or GiB; only ``0`` means the same in every
    unit), as is anything that is not a finite size."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(key, f"expected a size, got {value!r}", _SIZE_FIX)
    if isinstance(value, (int, float)) or (isinstance(value, str) and _NUMBER.match(value)):
        number = value if isinstance(value, int) else float(value)
        if number == 0:
            return 0
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(key, f"size {value!r} is not a finite number of bytes", _SIZE_FIX)
        if number < 0:
            raise ConfigError(key, f"size {value!r} is negative", "use a positive size")
        shown = str(value).strip()
        fix = (f"write the unit, e.g. {shown}GiB, {shown}MB, or {shown}B for bytes"
               if re.fullmatch(r"\d+(\.\d+)?", shown) else _SIZE_FIX)
        raise ConfigError(key, f"size {shown!r} has no unit", fix)
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a size, got {type(value).__name__} {value!r}", _SIZE_FIX)
    m = _SIZE.match(value)
    if not m:
        if value.strip().startswith("-"):
            raise ConfigError(key, f"size {value!r} is negative", "use a positive size")
        raise ConfigError(key, f"cannot read size {value!r}", _SIZE_FIX)
    unit, suffix = (m.group(2) or "").lower(), (m.group(3) or "").lower()
    n = float(m.group(1)) * (1000 if suffix == "b" else 1024) ** _UNITS[unit]
    if not math.isfinite(n):
        raise ConfigError(key, f"size {value!r} is not a finite number of bytes", _SIZE_FIX)
    return int(n)


_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$|^\s*[-+]?(inf|infinity|nan)\s*$", re.IGNORECASE)


def fmt_bytes(n: float) -> str:
    """A byte count for people: ``3.5 GiB``, ``512 B`` (binary units)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(key, f"expected true or false, got {value!r}", "write true or false")


def size_field(default: int, doc: str) -> Any:
    return field(default=default, metadata={"size": True, "doc": doc})


def opt(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None) -> Any:
    """A config key: its default, its one-line doc, and its range (``ge``:
    at least; ``gt``: greater than), which ``build`` checks for every key."""
    meta: dict[str, Any] = {"doc": doc}
    if ge is not None:
        meta["ge"] = ge
    if gt is not None:
        meta["gt"] = gt
    return field(default=default, metadata=meta)


def check_watermarks(prefix: str, low: float, high: float) -> None:
    """A collector's watermarks (shared directory, S3): 0 < low < high <= 1."""
    if not 0 < low < high <= 1:
        raise ConfigError(
            f"{prefix}low_watermark",
            f"need 0 < low_watermark ({low}) < high_watermark ({high}) <= 1",
            "use e.g. low_watermark: 0.85, high_watermark: 0.95",
        )


def build(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from loose values, naming bad keys.

    ``prefix`` is the path of this object in the user's config, used in messages.
    """
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        name = str(raw_key).replace("-", "_")
        full = f"{prefix}{name}"
        if name not in known:
            raise ConfigError(full, "unknown key", f"use one of: {', '.join(sorted(known))}")
        f = known[name]
        kwargs[name] = _coerce(value, hints[name], f, full)
        _check_range(kwargs[name], f, full)
    missing = [
        n for n, f in known.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}", "is required", f"set {prefix}{missing[0]}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(prefix)
    return obj


def _check_range(value: Any, f: dataclasses.Field, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}", f"set {key} to a number of {_unit(key)}")
    ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
    if ge is not None and value < ge:
        raise ConfigError(key, f"must be at least {ge:g}, got {value!r}", f"set {key} to {ge:g} or more")
    if gt is not None and value <= gt:
        raise ConfigError(key, f"must be greater than {gt:g}, got {value!r}", f"set {key} to more than {gt:g}")


def _unit(key: str) -> str:
    return "seconds" if key.endswith("_s") else "units, e.g. 1"


def _coerce(value: Any, hint: Any, f: dataclasses.Field, key: str) -> Any:
    """``value`` as the type of its key. Strings are read (environment
    variables and URL options are text); other types are taken only where
    nothing is lost or guessed: no bool for a number (``True`` is an int in
    Python), no fraction for an integer, nothing but a string for a string."""
    if f.metadata.get("size"):
        return parse_size(value, key)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        return parse_bool(value, key)
    if hint in (int, float):
        return _number(value, hint, key)
    if hint is str:
        if isinstance(value, str):
            return value
        # A number is refused too: YAML reads 0123 as 83 and 1e3 as text,
        # so what it made of an unquoted value is not what was written.
        shown = describe_value(value) if f.repr else f"a {type(value).__name__} (a secret's value is never shown)"
        raise ConfigError(key, f"expected a string, got {shown}",
                          f"write {key} as a string (in quotes if it looks like a number), or leave it out for its default")
    return value


def _number(value: Any, hint: type, key: str) -> int | float:
    word = "a whole number" if hint is int else "a number"
    if isinstance(value, str):
        try:
            return hint(value.strip())
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return hint(value)
    elif isinstance(value, float) and (hint is float or value.is_integer()):
        return hint(value)
    raise ConfigError(key, f"expected {word}, got {describe_value(value)}", f"write {word} for {key}")


def describe_value(value: Any) -> str:
    """``value`` for a message: its repr, with its type where the repr alone is ambiguous."""
    return repr(value) if isinstance(value, (str, int, float)) or value is None else f"{type(value).__name__} {value!r}"
