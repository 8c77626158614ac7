"""Benchmarks: storage (``kvtier bench storage``) and, later, end to end."""
