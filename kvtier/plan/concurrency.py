"""TTFT of sessions returning at once: ``kvtier plan --sweep``.

A burst is ``c`` sessions sent together, each with ``B`` bytes of KV in a
tier and a short suffix to compute over it (the shape of
``kvtier bench resume --concurrency``). Two stages serve it:

**The tier.** Every load pays a fixed latency ``lat`` (the connector finding
the hit and seeing the read done) and shares the tier's aggregate read rate
``R_c`` (what the device gives ``c`` streams, e.g. fio at ``c`` jobs). Loads
end one after another as the bytes arrive: the k-th at
``L_k = lat + k * B / R_c``.

**The engine.** ``S`` is the engine's own resume (the suffix's compute and
a step's fixed cost ``o``, measured with the KV already in the engine). A
step computing ``n`` suffixes lasts ``o + n * (S - o)``. Which sessions join
a step is the engine's step policy (``ENGINE_STEPS``):

    batched    every session whose load has ended joins the next step (vLLM
               schedules every request whose KV is ready): a burst's loads
               end close together, so after a first step with the first
               load alone, one step computes the rest and they all see
               their first token at its end.
    staggered  one finished load joins each step: T_k = max(T_(k-1), L_k) + S,
               the k-th session's first token at about L_1 + k * S when loads
               are fast.

The engine never starts a step before a load has ended. Predicted
percentiles are those of T_1 .. T_c (``kvtier.bench.resume_report.pct``,
the same interpolation as the sweep's report).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.bench.resume_report import pct
from kvtier.errors import ConfigError

ENGINE_STEPS = ("batched", "staggered")
GB = 1e9


@dataclass(frozen=True)
class Burst:
    sessions: int              # c: sessions sent at once
    bytes_per_session: float   # B: bytes each load reads from the tier
    read_gbps: float           # R_c: the tier's aggregate read rate at c streams, GB/s
    load_latency_s: float      # lat: fixed cost of each load
    engine_s: float            # S: the engine's own resume, its step overhead included
    step_overhead_s: float = 0.0  # o: a step's fixed cost, paid once per step (at most S)
    engine_steps: str = "batched"

    def __post_init__(self):
        if self.engine_steps not in ENGINE_STEPS:
            raise ConfigError("--engine-steps", f"unknown step policy {self.engine_steps!r}",
                              f"use one of: auto, {', '.join(ENGINE_STEPS)}")
        if self.sessions < 1 or self.read_gbps <= 0 or self.engine_s <= 0:
            raise ConfigError("--sweep", f"a burst needs sessions >= 1, a positive read rate and engine time, got "
                              f"{self.sessions} sessions, {self.read_gbps} GB/s, {self.engine_s} s",
                              "pass --concurrency, --read-rate and --engine-s with positive values")


def load_ends(b: Burst) -> list[float]:
    """L_1 .. L_c: when each session's load has read its last byte."""
    per = b.bytes_per_session / (b.read_gbps * GB)
    return [b.load_latency_s + k * per for k in range(1, b.sessions + 1)]


def first_tokens(b: Burst) -> list[float]:
    """T_1 .. T_c: each session's first token, from the burst's send."""
    ends = load_ends(b)
    o = min(b.step_overhead_s, b.engine_s)
    out: list[float] = []
    t, i = 0.0, 0
    while i < len(ends):
        start = max(t, ends[i])
        n = 1
        if b.engine_steps == "batched":
            while i + n < len(ends) and ends[i + n] <= start:
                n += 1
        t = start + o + n * (b.engine_s - o)
        out += [t] * n
        i += n
    return out


def predict(b: Burst) -> dict:
    """The burst's predicted TTFT percentiles and what bounds it."""
    ts = first_tokens(b)
    load_s = b.bytes_per_session / (b.read_gbps * GB)
    return {"sessions": b.sessions, "read_gbps": b.read_gbps, "load_s": load_s,
            "loads_done_s": load_ends(b)[-1], "engine_s": b.engine_s, "engine_steps": b.engine_steps,
            "bound": "tier" if load_s > b.engine_s else "engine",
            "ttft_p50_s": pct(ts, 0.5), "ttft_p90_s": pct(ts, 0.9), "ttft_p99_s": pct(ts, 0.99)}


def detect_steps(bursts: list[list[float]], engine_s: float) -> str | None:
    """The step policy a run shows: ``batched`` when most sessions of its
    bursts shared their first-token moment with another (a step computed
    several suffixes), ``staggered`` when most had their own; None when no
    burst has three sessions or more (two cannot tell: batched puts the
    first load alone in its step too). ``bursts`` holds each burst's
    first-token times; moments closer than a quarter of ``S`` are one step."""
    moments = sessions = 0
    for ts in bursts:
        if len(ts) < 3:
            continue
        ts = sorted(ts)
        moments += 1 + sum(1 for a, b in zip(ts, ts[1:]) if b - a > 0.25 * engine_s)
        sessions += len(ts)
    if not sessions:
        return None
    return "staggered" if moments > sessions / 2 else "batched"


_RATE = re.compile(r"^\s*([0-9.]+(?:e-?[0-9]+)?)\s*(gb|gib|mb|mib)?(?:/s|ps)?\s*$", re.I)
_UNIT = {None: 1.0, "gb": 1.0, "gib": (1 << 30) / GB, "mb": 1e-3, "mib": (1 << 20) / GB}


def parse_rate(text: str) -> float:
    """GB/s from ``2``, ``2GB``, ``2GB/s``, ``1.5GiB/s``, ``800MB/s``."""
    m = _RATE.match(text)
    value = float(m.group(1)) * _UNIT[(m.group(2) or "").lower() or None] if m else 0.0
    if not m or value <= 0:
        raise ConfigError("--read-rate", f"cannot read {text!r} as a read rate",
                          "write GB/s, e.g. --read-rate 2GB/s, or per number of streams, e.g. 1:8.2,8:6.6")
    return value


def parse_rates(text: str) -> dict[int, float]:
    """``--read-rate``: one rate for every level (``2GB/s``, key 0) or a rate
    per number of streams (``1:8.2,8:6.6,16:6.5``)."""
    if ":" not in text:
        return {0: parse_rate(text)}
    out: dict[int, float] = {}
    for part in (p for p in text.split(",") if p.strip()):
        streams, _, rate = part.partition(":")
        if not streams.strip().isdigit() or int(streams) < 1:
            raise ConfigError("--read-rate", f"{part!r} does not start with a number of streams",
                              "write STREAMS:GBPS pairs, e.g. 1:8.2,8:6.6,16:6.5")
        out[int(streams)] = parse_rate(rate)
    return out


def rate_at(rates: dict[int, float], c: int) -> float:
    """The aggregate rate at ``c`` streams: the one measured at the most
    streams not above ``c`` (more streams than measured get no faster), or
    at the fewest when every measurement has more."""
    if 0 in rates:
        return rates[0]
    below = [s for s in rates if s <= c]
    return rates[max(below)] if below else rates[min(rates)]
