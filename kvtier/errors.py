"""Exceptions that cross module boundaries.

Storage trouble is *not* an exception at the TieredStore surface: tiers turn
it into misses (invariant 4). What remains here is what a caller must act on.
"""


class KVTierError(Exception):
    """Base class of kvtier's own errors."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is wrong. Names the key and says how to fix it."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(f"config key '{key}': {problem}. Fix: {fix}")


class CorruptObject(KVTierError):
    """A stored object failed a format, identity or checksum check.

    Raised inside tiers only; a tier turns it into a miss, counts it and
    quarantines the object.
    """
