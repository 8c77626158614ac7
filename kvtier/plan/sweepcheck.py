"""``kvtier plan --validate DIR`` on a concurrency sweep (``kvtier bench resume
--concurrency``): the burst model of ``kvtier.plan.concurrency`` against
what each level measured.

Per case, kvtier configuration and level, the burst is predicted from what
the run itself says about its parts, never from the burst's own TTFTs:

    B    the bytes kvtier read per request at that level (``read_bytes_per_request``)
    R_c  fio's aggregate rate at c streams (``device.gbps_by_streams``; the
         modelled local drive no faster than its throttle); ``--read-rate`` instead
    S    the engine's own resume: the median of the "engine" phase over the
         case's configurations (one request each per round; the engine's work is
         the same in each, so their median resists one slow sample); ``--engine-s``
    o    a step's fixed cost: ``--step-overhead-ms``, or the constant of the
         prefill law fitted to the run's requests without a connector that ran
         alone (as ``validate.py``)
    lat  the load latency (``--load-latency-ms``, default the shared tier's)
    steps  ``--engine-steps``, or what the configuration's bursts show
         (``concurrency.detect_steps``; batched when no burst has 3 sessions)

and its TTFT p50 compared with the measured p50: within 20% is met. Exit
status 1 when a row is missed. Configurations without a connector
(recompute, prefix-cache) load nothing and are not modelled here.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.plan import concurrency, cost

TOLERANCE = 0.20


@dataclass
class LevelRow:
    case: str
    config: str
    sessions: int
    engine_steps: str
    steps_from: str            # "run", "--engine-steps" or "assumed"
    read_gbps: float
    measured_p50: float
    predicted_p50: float
    measured_p90: float
    predicted_p90: float

    @property
    def ratio(self) -> float:
        return self.predicted_p50 / self.measured_p50 if self.measured_p50 else float("nan")

    @property
    def ok(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "ok": self.ok}


def find(results_dir: Path) -> Path | None:
    """The sweep.json of a sweep run's directory (or its report/), if it is one."""
    for d in (results_dir, results_dir / "report"):
        p = d / "sweep.json"
        if p.is_file():
            return p
    return None


def _records(sweep_json: Path) -> list[dict]:
    req = sweep_json.parent / "requests.jsonl"
    if not req.is_file():
        return []
    with open(req) as f:
        return [json.loads(line) for line in f if line.strip()]


def _rates(doc: dict, override: str | None) -> dict[int, float]:
    if override:
        return concurrency.parse_rates(override)
    dev = doc.get("device") or {}
    rates = {int(k): float(v) for k, v in (dev.get("gbps_by_streams") or {}).items() if v}
    if not rates and dev.get("best_gbps"):
        rates = {0: float(dev["best_gbps"])}
    if not rates:
        raise ConfigError("--read-rate", "the sweep run measured no device rate (fio did not run)",
                          "pass the tier's read rate, e.g. --read-rate 2GB/s or 1:8.2,8:6.6")
    return rates


def _engine_s(by: dict, override: float | None) -> float | None:
    if override is not None:
        return override
    xs = [v["engine_s"] for v in by.values() if v.get("engine_s")]
    return statistics.median(xs) if xs else None


def _steps(recs: list[dict], engine_s: float, override: str | None) -> tuple[str, str]:
    if override and override != "auto":
        return override, "--engine-steps"
    bursts: dict[tuple, list[float]] = defaultdict(list)
    for r in recs:
        if re.fullmatch(r"c\d+", str(r.get("phase", ""))) and r.get("t_first") is not None:
            bursts[(r.get("round", 0), r["phase"])].append(float(r["t_first"]))
    seen = concurrency.detect_steps(list(bursts.values()), engine_s)
    return (seen, "run") if seen else ("batched", "assumed")


def run(sweep_json: Path, prefill: cost.PrefillModel | None = None, read_rate: str | None = None,
        engine_s: float | None = None, engine_steps: str | None = None,
        load_latency_s: float | None = None, step_overhead_s: float | None = None) -> tuple[list[LevelRow], cost.PrefillModel, dict]:
    """The rows of the validation, the law used and the sweep's document."""
    from kvtier.plan.validate import BLOCK, calibrate

    try:
        doc = json.loads(sweep_json.read_text())
        records = _records(sweep_json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("--validate", f"cannot read the sweep run in {sweep_json.parent}: {exc}",
                          "pass the directory of a finished kvtier bench resume --concurrency run") from None
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r.get("config"), str(r.get("case", "")), r.get("round", 0))].append(r)
    law = prefill or calibrate(groups, cost.PrefillModel())
    o = law.c if step_overhead_s is None else step_overhead_s
    rates = _rates(doc, read_rate)
    lat = cost.DEFAULT_IO["shared"].latency_s if load_latency_s is None else load_latency_s
    local_cap = (doc.get("device") or {}).get("local_drive_bps")
    rows: list[LevelRow] = []
    for case, by in (doc.get("results") or {}).items():
        s = _engine_s(by, engine_s)
        for config, v in by.items():
            base = config.removesuffix("+mp")
            if not base.startswith("kvtier"):
                continue
            mine = [r for r in records if r.get("config") == config and str(r.get("case", "")) == case]
            if s is None:  # no engine phase measured: the law's resume of this burst's prompts
                prompt = max((r["prompt_tokens"] for r in mine), default=0)
                if not prompt:
                    raise ConfigError("--engine-s", f"case {case}: the run has neither an engine phase nor requests",
                                      "pass the engine's own resume time, e.g. --engine-s 0.5")
                s = law.seconds(prompt, (prompt - 1) // BLOCK * BLOCK)
            steps, steps_from = _steps(mine, s, engine_steps)
            for c, lv in v["levels"].items():
                nbytes = lv.get("read_bytes_per_request") or 0.0
                if not lv.get("requests") or not nbytes:
                    continue  # nothing loaded: no burst through the tier to model
                rate = concurrency.rate_at(rates, int(c))
                if base == "kvtier-local-drive" and local_cap and not read_rate:
                    rate = min(rate, local_cap / 1e9)
                p = concurrency.predict(concurrency.Burst(int(c), nbytes, rate, lat, s, o, steps))
                rows.append(LevelRow(case, config, int(c), steps, steps_from, rate, lv["ttft_p50_s"],
                                     p["ttft_p50_s"], lv["ttft_p90_s"], p["ttft_p90_s"]))
    return rows, law, doc


def format_rows(rows: list[LevelRow], law: cost.PrefillModel, doc: dict, lat: float, o: float) -> str:
    lines = [doc.get("description", "concurrency sweep"),
             f"prefill law: {law.a:.4g}*n + {law.b:.4g}*n^2 + {law.c:.3g} s ({law.source}); "
             f"step overhead {o * 1000:.0f} ms; load latency {lat * 1000:.0f} ms", "",
             f"{'case':>6}  {'configuration':<22}{'sessions':>8}  {'engine steps':<22}{'read GB/s':>9}"
             f"{'TTFT p50 m / p':>18}{'ratio':>7}{'p90 m / p':>17}  verdict"]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        steps = r.engine_steps + ("" if r.steps_from == "--engine-steps" else f" ({r.steps_from})")
        lines.append(f"{r.case:>6}  {r.config:<22}{r.sessions:>8}  {steps:<22}{r.read_gbps:>9.2f}"
                     f"{r.measured_p50:>9.2f}s/{r.predicted_p50:>6.2f}s{r.ratio:>7.2f}"
                     f"{r.measured_p90:>8.2f}s/{r.predicted_p90:>6.2f}s  {'met' if r.ok else 'MISSED'}")
    return "\n".join(lines)


def main(args, sweep_json: Path) -> int:
    from kvtier.plan.flags import parse_prefill, step_overhead
    from kvtier.plan.validate import calibrate_run

    prefill, lat = None, cost.DEFAULT_IO["shared"].latency_s
    if args.calibrate:
        prefill, io = calibrate_run(args.calibrate)
        lat = io["shared"].latency_s
        prefill = cost.PrefillModel(prefill.a, prefill.b, prefill.c, f"fitted to {args.calibrate}")
    if args.prefill:
        prefill = parse_prefill(args.prefill)
    if args.engine_s is not None and args.engine_s <= 0:
        raise ConfigError("--engine-s", f"must be positive, got {args.engine_s}",
                          "pass the TTFT of a resume whose KV is already in the engine, in seconds")
    if args.load_latency_ms is not None and args.load_latency_ms < 0:
        raise ConfigError("--load-latency-ms", f"must be 0 or more, got {args.load_latency_ms}", "pass e.g. 40")
    if args.load_latency_ms is not None:
        lat = args.load_latency_ms / 1000
    o = step_overhead(args, prefill or cost.PrefillModel()) if args.step_overhead_ms is not None else None
    rows, law, doc = run(sweep_json, prefill, args.read_rate, args.engine_s, args.engine_steps, lat, o)
    if not rows:
        print(f"no kvtier configuration with loads in {sweep_json}: nothing to predict")
        return 1
    ok = all(r.ok for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "prefill": law.__dict__, "load_latency_s": lat,
                          "rows": [r.to_json() for r in rows]}, indent=2))
    else:
        print(format_rows(rows, law, doc, lat, law.c if o is None else o) + "\n")
    print(f"validation {'passed' if ok else 'FAILED'}: TTFT p50 at every level within {TOLERANCE:.0%} "
          f"of the burst model ({sum(r.ok for r in rows)}/{len(rows)} rows met)", file=sys.stderr if args.json else sys.stdout)
    return 0 if ok else 1
