"""``kvtier plan --validate RESULTS_DIR``: the simulator against a measured run.

A ``kvtier bench resume`` run leaves ``requests.jsonl`` (one record per
request: what was sent, when, by which configuration, and the TTFT and cached
tokens measured) and ``results.json`` (per case and configuration: the
tokens each kvtier tier served, TTFT percentiles, the fio bandwidth). Each
(configuration, case, round) ran in fresh engines on an empty store, so each
is replayed by a fresh simulator with what that configuration ran
(``kvtier.bench.resume_configs.engine_spec``): its tiers and capacities,
chunks of 256 tokens, engine blocks of 128, the engine's KV size, prefix
caching off for ``recompute``, the log's own instance for every request.

Checks, per case and configuration:
    hit tokens of every kvtier tier   equal to what the tier served (vLLM's
                                      external hit tokens by tier)
    TTFT p50 of the measured phases   within 15% of the measured p50

The prefill model is fitted to the requests of the same run that had no
connector (recompute, and the engine prefix cache: the part it did not hold)
and ran alone in their engine (or ``--calibrate``/``--prefill``); those rows
therefore check the fit, not the simulator, and say "(calibration)".
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.bench.models import PRESETS as SHAPES
from kvtier.bench.models import ModelShape
from kvtier.errors import ConfigError
from kvtier.plan import cost
from kvtier.plan.loaders import load_kvtier_log
from kvtier.plan.sim import PlanConfig, Simulator, TierPlan

GiB = 1 << 30
TTFT_TOLERANCE = 0.15
BLOCK, CHUNK = 128, 256
# What kvtier bench resume gives each configuration (kvtier/bench/resume_configs.py).
CONFIG_TIERS = {
    "kvtier-memory": (("memory", 8 * GiB),),
    "kvtier-disk": (("disk", 32 * GiB),),
    "kvtier-local-disk": (("disk", 32 * GiB),),
    "kvtier-shared": (("shared", 32 * GiB),),
    "recompute": (),
    "prefix-cache": (),
}


CALIBRATION_CONFIGS = ("recompute", "prefix-cache")


@dataclass
class Row:
    workload: str
    case: str
    config: str
    prompt_tokens: int
    measured_hits: dict
    predicted_hits: dict
    measured_engine: int | None
    predicted_engine: int
    measured_p50: float
    predicted_p50: float
    requests: int
    pred: list = field(default_factory=list, repr=False)  # TTFTs of the measured phases
    meas: list = field(default_factory=list, repr=False)

    @property
    def hits_equal(self) -> bool:
        tiers = set(self.measured_hits) | set(self.predicted_hits)
        return all(round(self.measured_hits.get(t, 0)) == self.predicted_hits.get(t, 0) for t in tiers)

    @property
    def ttft_ratio(self) -> float:
        return self.predicted_p50 / self.measured_p50 if self.measured_p50 else float("nan")

    @property
    def ttft_ok(self) -> bool:
        return abs(self.ttft_ratio - 1) <= TTFT_TOLERANCE

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("pred", "meas")}
        return {**d, "hits_equal": self.hits_equal, "ttft_ratio": self.ttft_ratio, "ttft_ok": self.ttft_ok}


def find(results_dir: Path) -> tuple[Path, Path | None]:
    for d in (results_dir, results_dir / "report"):
        if (d / "requests.jsonl").is_file():
            res = d / "results.json"
            return d / "requests.jsonl", res if res.is_file() else None
    raise ConfigError("--validate", f"no requests.jsonl in {results_dir} or {results_dir / 'report'}",
                      "pass the directory of a kvtier bench resume run (its --dir, or its report/)")


def model_shape(name: str) -> ModelShape:
    if name in SHAPES:
        return SHAPES[name]
    from kvtier.bench.tinymodels import PRESETS as TINY

    if name in TINY:
        _, layers, hidden, heads, kv_heads, _, _ = TINY[name]
        return ModelShape(name, layers, kv_heads, hidden // heads)
    raise ConfigError("model", f"unknown model {name!r} in the request log", f"known: {', '.join(SHAPES)}")


def calibrate_run(path: str | Path, io: dict | None = None) -> tuple[cost.PrefillModel, dict[str, cost.TierIO]]:
    """Prefill law and per-tier load latency from a ``kvtier bench resume`` run.

    The law is fitted to its requests without a connector that ran alone; each tier's
    latency is the median, over the hits it served alone, of the measured
    TTFT minus the law's prefill of the uncached tokens, the bytes over the
    tier's bandwidth and the copy into engine blocks."""
    req, _ = find(Path(path)) if Path(path).is_dir() else (Path(path), None)
    with open(req) as f:
        records = [json.loads(line) for line in f if line.strip()]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r.get("config"), str(r.get("case", "")), r.get("round", 0))].append(r)
    prefill = calibrate(groups, cost.PrefillModel())
    io = dict(io or cost.DEFAULT_IO)
    by_tier: dict[str, list[float]] = defaultdict(list)
    for (config, _, _), recs in groups.items():
        tiers = CONFIG_TIERS.get(config, ())
        if len(tiers) != 1:
            continue
        kind = tiers[0][0]
        bpt = model_shape(recs[0].get("model", "qwen2.5-0.5b")).bytes_per_token
        for r in cost.alone(recs):
            h = r.get("cached_tokens") or 0
            if h <= 0:
                continue
            rest = r["ttft_s"] - prefill.seconds(r["prompt_tokens"], h) - h * bpt / (io[kind].gbps * 1e9) \
                - h * bpt / (cost.DEFAULT_COPY_GBPS * 1e9)
            by_tier[kind].append(rest)
    for kind, xs in by_tier.items():
        io[kind] = cost.TierIO(io[kind].gbps, max(0.0, statistics.median(xs)))
    return prefill, io


def calibrate(groups: dict, fallback: cost.PrefillModel) -> cost.PrefillModel:
    """The prefill law of the engine alone: fitted to the requests of the
    configurations without a connector (recompute: whole prompts; the engine
    prefix cache: what it did not hold, against the context it held) that
    ran alone. Those rows of the validation therefore check the fit; the
    kvtier rows are predicted from it."""
    samples = []
    for (cfg, _, _), recs in groups.items():
        if cfg in CALIBRATION_CONFIGS:
            samples += [(r["prompt_tokens"], r.get("cached_tokens") or 0, r["ttft_s"]) for r in cost.alone(recs)]
    if not samples:
        return fallback
    return cost.fit_prefill(samples, source=f"fitted to {len(samples)} requests of the validated run without a connector")


def _engine_blocks(recs: list[dict], description: str) -> int:
    """The engine KV of the run: room for what runs at once, each request's
    longest prompt plus output, a spare block (and vLLM's null block, not usable)."""
    longest = max(r["prompt_tokens"] + max(1, r.get("output_tokens", 1)) for r in recs)
    per_request = -(-(longest + 8) // BLOCK)
    m = re.search(r"concurrency (\d+)", description or "")
    concurrency = int(m.group(1)) if m else 1
    instances = max(1, len({r.get("instance", 0) for r in recs}))
    concurrency = max(1, -(-concurrency // instances))
    return concurrency * per_request + 2 - 1


def _measured_phases(recs: list[dict]) -> set[str]:
    phases = {r.get("phase", "") for r in recs}
    return phases - {"warm"} or phases


def run_validation(requests_path: Path, results_path: Path | None, prefill: cost.PrefillModel | None = None,
                   io: dict | None = None) -> tuple[list[Row], cost.PrefillModel]:
    with open(requests_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    results = json.loads(results_path.read_text()) if results_path else {}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r.get("config"), str(r.get("case", "")), r.get("round", 0))].append(r)
    model_prefill = prefill or calibrate(groups, cost.PrefillModel())
    description = results.get("description", "")
    io = dict(io or cost.DEFAULT_IO)
    rows: dict[tuple, Row] = {}
    for (config, case, rnd), recs in sorted(groups.items(), key=lambda kv: (str(kv[0][1]), str(kv[0][0]), kv[0][2])):
        if config not in CONFIG_TIERS:
            continue  # peers (the ExampleConnector) have no model here
        fio = (results.get("fio") or {}).get(case, {})
        tio = dict(io)
        if fio.get("best_gbps"):  # the run measured its storage: cold reads go no faster
            for t in ("disk", "shared"):
                tio[t] = cost.TierIO(fio["best_gbps"], io[t].latency_s)
        shape = model_shape(recs[0].get("model", "qwen2.5-0.5b"))
        tiers = tuple(TierPlan(kind, cap, tio[kind]) for kind, cap in CONFIG_TIERS[config])
        instances = max(int(r.get("instance", 0) or 0) for r in recs) + 1
        cfg = PlanConfig(shape, tiers, CHUNK, BLOCK,
                         engine_blocks=None if config == "recompute" else _engine_blocks(recs, description),
                         instances=instances, routing="trace", prefill=model_prefill, curve_sample=0)
        trace = load_kvtier_log(requests_path, BLOCK, config=config, records=recs)
        sim = Simulator(cfg, keep_outcomes=True).run(trace)
        measured_phases = _measured_phases(recs)
        pred = [o.ttft_s for o in sim.outcomes if o.phase in measured_phases]
        meas = [o.measured_ttft_s for o in sim.outcomes if o.phase in measured_phases and o.measured_ttft_s is not None]
        key = (config, case)
        row = rows.get(key)
        hits = {k: v for k, v in sim.totals.tier_tokens.items()}
        meas_cached = sum(r.get("cached_tokens", 0) or 0 for r in recs)
        if row is None:
            row = rows[key] = Row(str(recs[0].get("workload", "")), case, config, 0, {}, {}, 0, 0, 0.0, 0.0, 0)
        row.prompt_tokens += sim.totals.prompt_tokens
        for k, v in hits.items():
            row.predicted_hits[k] = row.predicted_hits.get(k, 0) + v
        row.predicted_engine += sim.totals.engine_tokens
        row.measured_engine = (row.measured_engine or 0) + meas_cached  # minus kvtier's share below
        row.pred += pred
        row.meas += meas
        row.requests += len(pred)
    for (config, case), row in rows.items():
        measured = (results.get("results") or {}).get(case, {}).get(config, {})
        row.measured_hits = {t: measured.get("hit_tokens", {}).get(t, 0) for t in row.predicted_hits}
        for t, v in measured.get("hit_tokens", {}).items():
            row.measured_hits.setdefault(t, v)
        row.measured_engine = (row.measured_engine or 0) - round(sum(row.measured_hits.values()))
        row.measured_p50 = _median(row.meas)
        row.predicted_p50 = _median(row.pred)
    return list(rows.values()), model_prefill


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def format_rows(rows: list[Row], prefill: cost.PrefillModel, self_calibrated: bool = True) -> str:
    lines = [f"prefill model: {prefill.a:.4g}*n + {prefill.b:.4g}*n^2 + {prefill.c:.3g} s ({prefill.source})", "",
             (f"{'workload':<9}{'case':>6}  {'configuration':<18}{'kvtier hit tokens: measured / simulated':<42}"
             f"{'engine m/s':>17}{'TTFT p50 m / s':>20}{'ratio':>7}  verdict")]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        tiers = sorted(set(r.measured_hits) | set(r.predicted_hits))
        hits = ", ".join(f"{t} {round(r.measured_hits.get(t, 0))}/{r.predicted_hits.get(t, 0)}" for t in tiers) or "-"
        eng = f"{r.measured_engine}/{r.predicted_engine}"
        note = " (calibration)" if self_calibrated and r.config in CALIBRATION_CONFIGS else ""
        verdict = ("hits equal" if r.hits_equal else "HITS DIFFER") + ", " + ("TTFT ok" if r.ttft_ok else "TTFT OFF")
        lines.append(f"{r.workload:<9}{r.case:>6}  {r.config:<18}{hits:<42}{eng:>17}"
                     f"{r.measured_p50:>9.3f}s/{r.predicted_p50:>7.3f}s{r.ttft_ratio:>7.2f}  {verdict}{note}")
    return "\n".join(lines)


def main(args) -> int:
    req, res = find(Path(args.validate))
    prefill = None
    io = dict(cost.DEFAULT_IO)
    if getattr(args, "storage_json", None):
        io = cost.io_from_storage_json(args.storage_json, io)
    if getattr(args, "calibrate", None):
        # Another run (e.g. W1 to validate W2): its law and its tiers' latencies.
        prefill, io = calibrate_run(args.calibrate, io)
        prefill = cost.PrefillModel(prefill.a, prefill.b, prefill.c, f"fitted to {args.calibrate}")
        print("calibrated on " + args.calibrate + ": tier latency " + ", ".join(
            f"{k} {v.latency_s * 1000:.1f} ms" for k, v in io.items()), file=sys.stderr)
    if getattr(args, "prefill", None):
        a, b, c = (float(x) for x in args.prefill.split(","))
        prefill = cost.PrefillModel(a, b, c, "--prefill")
    rows, model = run_validation(req, res, prefill, io)
    if not rows:
        print(f"no configuration in {req} that kvtier plan models", file=sys.stderr)
        return 1
    if res is None:
        print(f"warning: no results.json beside {req}: measured per-tier hits unknown", file=sys.stderr)
    print(format_rows(rows, model, self_calibrated=prefill is None))
    if getattr(args, "calibrate", None) and Path(args.calibrate).resolve() in (Path(args.validate).resolve(), req.parent.resolve(), req.resolve()):
        print("\nnote: calibrated on the validated run itself: tier latencies were fitted to these very hits, "
              "so their TTFT agreement is by construction; calibrate on another run (e.g. W1 for W2)")
    ok = all(r.hits_equal and (r.ttft_ok or math.isnan(r.ttft_ratio)) for r in rows)
    if getattr(args, "json", False):
        print(json.dumps({"ok": ok, "prefill": model.__dict__, "rows": [r.to_json() for r in rows]}, indent=2, default=str))
    print("\nvalidation " + ("passed" if ok else "FAILED") + f": per-tier hit tokens equal, TTFT p50 within {TTFT_TOLERANCE:.0%}")
    return 0 if ok else 1
