"""Eviction policies: one seam (``base.EvictionPolicy``) that the memory,
disk and shm tiers, the shared tiers' collector and the capacity planner's
models all run, each policy chosen by name (``registry``)."""

from kvtier.tiers.eviction.base import EvictionPolicy, rank
from kvtier.tiers.eviction.registry import BUILTIN, check, make, policy_class

__all__ = ["BUILTIN", "EvictionPolicy", "check", "make", "policy_class", "rank"]
