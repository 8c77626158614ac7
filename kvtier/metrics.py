"""Prometheus metrics, one label set per tier.

A ``Metrics`` owns a registry (its own by default, so several stores in one
process never collide; pass ``prometheus_client.REGISTRY`` to expose next to
an engine's metrics). Tiers receive a ``TierMetrics`` with the label bound.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "kvtier"):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, prefix
        self.hits = Counter(f"{p}_hit_chunks", "Chunks found and served by a tier", ["tier"], registry=r)
        self.misses = Counter(f"{p}_miss_chunks", "Chunks asked of a tier and not served", ["tier"], registry=r)
        self.hit_tokens = Counter(f"{p}_hit_tokens", "Tokens whose KV a tier served", ["tier"], registry=r)
        self.read_bytes = Counter(f"{p}_read_bytes", "Object bytes read from a tier", ["tier"], registry=r)
        self.written_bytes = Counter(f"{p}_written_bytes", "Object bytes written to a tier", ["tier"], registry=r)
        self.stored = Counter(f"{p}_stored_chunks", "Chunks published in a tier", ["tier"], registry=r)
        self.store_skipped = Counter(
            f"{p}_store_skipped_chunks", "Stores skipped because the object was already there", ["tier"], registry=r
        )
        self.integrity = Counter(
            f"{p}_integrity_failures", "Objects that failed format, identity or checksum checks", ["tier"], registry=r
        )
        self.auth_failures = Counter(
            f"{p}_auth_failures",
            "Objects a tier returned that were not served because their seal did not prove a holder of the cluster "
            "key wrote them, by reason: unsealed (no seal), unknown_key (a key this node does not hold), bad_seal "
            "(forged, tampered or spliced)",
            ["tier", "reason"], registry=r,
        )
        self.errors = Counter(f"{p}_errors", "Backend errors (I/O, timeouts)", ["tier", "op"], registry=r)
        self.dropped = Counter(
            f"{p}_dropped_saves", "Chunks not written to a tier (queue full, breaker open, no space)", ["tier", "reason"], registry=r
        )
        self.evictions = Counter(f"{p}_evicted_chunks", "Chunks evicted to respect capacity", ["tier"], registry=r)
        self.latency = Histogram(
            f"{p}_op_seconds", "Latency of tier operations", ["tier", "op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.used_bytes = Gauge(f"{p}_used_bytes", "Bytes held by a tier (this instance's view)", ["tier"], registry=r)
        self.capacity_bytes = Gauge(f"{p}_capacity_bytes", "Configured capacity of a tier", ["tier"], registry=r)
        self.breaker_open = Gauge(f"{p}_breaker_open", "1 while a tier's circuit breaker skips it", ["tier"], registry=r)
        self.read_path_loads = Counter(
            f"{p}_read_path_loads", "Loads a directory tier read by each path (direct: O_DIRECT; buffered)",
            ["tier", "path"], registry=r,
        )
        self.aio_reads = Gauge(
            f"{p}_aio_reads", "1 while a directory tier issues its O_DIRECT reads with native AIO; 0 once it reads "
            "them with pool threads (the kernel refused AIO there, or its AIO loads spent most of their time opening "
            "files, one at a time)",
            ["tier"], registry=r,
        )
        self.load_drivers = Counter(
            f"{p}_load_drivers_total",
            "A directory tier's loads by what drove their reads: native (kvtier's native read loop), aio (the "
            "Python driver with native AIO), threads (a pool thread per read)",
            ["tier", "driver"], registry=r,
        )
        self.read_path_rate = Gauge(
            f"{p}_read_path_rate_bytes_per_second",
            "A directory tier's moving average of its loads' read rate, per path (adaptive reads choose by it)",
            ["tier", "path"], registry=r,
        )
        self.io_cpu = Counter(
            f"{p}_io_cpu_seconds",
            "CPU seconds a tier's I/O threads spent on its jobs (each thread's own clock), by kind: load (lookups, "
            "reads and their verification), store (writes), delete, maintenance. With kvtier_read_bytes: CPU per "
            "byte read; add kvtier_load_caller_cpu_seconds for a load's whole cost",
            ["tier", "kind"], registry=r,
        )
        self.load_caller_cpu = Counter(
            f"{p}_load_caller_cpu_seconds",
            "CPU seconds the threads asking for loads spent inside them (taking each verified object off the tiers' "
            "reads, copies out of the memory tier, promotion), not counting the consumer's own work between objects",
            registry=r,
        )

    def for_tier(self, tier: str) -> "TierMetrics":
        return TierMetrics(self, tier)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: Any) -> float:
        """Current value of one sample (tests and reports)."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v


class TierMetrics:
    """One tier's view of ``Metrics``: its label bound. Each labelled child is
    looked up once and kept (``labels()`` hashes and locks on every call, and
    a cold load counts a few samples per object read)."""

    __slots__ = ("m", "tier", "_children")

    def __init__(self, m: Metrics, tier: str):
        self.m = m
        self.tier = tier
        self._children: dict[tuple, Any] = {}

    def _child(self, metric, *extra: str):
        key = (id(metric), extra)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(self.tier, *extra)
        return c

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TierMetrics) and other.m is self.m and other.tier == self.tier

    def __hash__(self) -> int:
        return hash((id(self.m), self.tier))

    def hit(self, chunks: int, tokens: int, nbytes: int) -> None:
        if chunks:
            self._child(self.m.hits).inc(chunks)
            self._child(self.m.hit_tokens).inc(tokens)
            self._child(self.m.read_bytes).inc(nbytes)

    def miss(self, chunks: int = 1) -> None:
        if chunks:
            self._child(self.m.misses).inc(chunks)

    def wrote(self, nbytes: int) -> None:
        self._child(self.m.stored).inc()
        self._child(self.m.written_bytes).inc(nbytes)

    def skipped(self) -> None:
        self._child(self.m.store_skipped).inc()

    def corrupt(self) -> None:
        self._child(self.m.integrity).inc()

    def auth_failed(self, reason: str) -> None:
        self._child(self.m.auth_failures, reason).inc()

    def error(self, op: str) -> None:
        self._child(self.m.errors, op).inc()

    def dropped(self, reason: str, chunks: int = 1) -> None:
        if chunks:
            self._child(self.m.dropped, reason).inc(chunks)

    def evicted(self, chunks: int = 1) -> None:
        self._child(self.m.evictions).inc(chunks)

    def observe(self, op: str, seconds: float) -> None:
        self._child(self.m.latency, op).observe(seconds)

    def read_path(self, path: str, rate: float | None) -> None:
        """A load was read by ``path``; ``rate``: that path's moving average
        now (bytes/s), if the load counted."""
        self._child(self.m.read_path_loads, path).inc()
        if rate is not None:
            self._child(self.m.read_path_rate, path).set(rate)

    def job_cpu(self, kind: str, seconds: float) -> None:
        """A job of the tier's executor ran (``kind``: load, store, delete
        or maintenance) and its thread spent ``seconds`` of CPU on it."""
        self._child(self.m.io_cpu, kind).inc(seconds)

    def load_driver(self, driver: str) -> None:
        self._child(self.m.load_drivers, driver).inc()

    def aio_reads(self, on: bool) -> None:
        self._child(self.m.aio_reads).set(1 if on else 0)

    def used(self, nbytes: int) -> None:
        self._child(self.m.used_bytes).set(nbytes)

    def capacity(self, nbytes: int) -> None:
        self._child(self.m.capacity_bytes).set(nbytes)

    def breaker(self, is_open: bool) -> None:
        self._child(self.m.breaker_open).set(1 if is_open else 0)
