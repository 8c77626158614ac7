"""Orchestration above the tiers: executors, circuit breakers, the TieredStore."""
