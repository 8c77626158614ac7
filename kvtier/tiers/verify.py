"""Offline verification of a directory tier (``kvtier store verify``).

Without the token ids a reader cannot recompute keys, so an offline check
verifies what the object itself promises: the header parses, its key is the
one in the file name, its namespace is the one of its folder, the payload is
complete and its checksum matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from kvtier.errors import CorruptObject
from kvtier.keys import ChunkKey
from kvtier.codec import HEADER_STRUCT_SIZE, parse_header
from kvtier.tiers.files import ObjectDir, ObjectEntry


@dataclass
class VerifyReport:
    ok: int = 0
    bad: list[tuple[Path, str]] = field(default_factory=list)


def verify_directory(odir: ObjectDir, entries: Sequence[ObjectEntry], quarantine: bool,
                     tick: Callable[[int], None]) -> VerifyReport:
    """Read and check every object; with ``quarantine``, move bad ones aside
    the way the tiers do (``ObjectDir.quarantine``); otherwise write nothing."""
    report = VerifyReport()
    for e in entries:
        try:
            with open(e.path, "rb") as f:
                head = f.read(HEADER_STRUCT_SIZE)
            h = parse_header(head)
            if h.key.hex() != e.key_hex or h.ns[:8].hex() != e.ns_hex:
                raise CorruptObject("header key or namespace does not match the object's path")
            key = ChunkKey(h.key, h.check, h.ns, h.num_tokens)
            odir.read(key, o_direct=False, cold=True)
            report.ok += 1
        except FileNotFoundError:
            pass  # collected meanwhile
        except (CorruptObject, OSError) as exc:
            report.bad.append((e.path, str(exc)))
            if quarantine:
                odir.quarantine_path(e.path)
        tick(1)
    return report
