"""Orchestration above the tiers: the ``TieredStore``."""
