"""What several modes of ``kvtier plan`` read from the same flags: the KV
shape, the prefill law, each tier's bandwidth and latency, an engine step's
fixed cost. Imported by the modes' handlers, never by ``kvtier.plan.cli``'s
parser."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.plan import cost


def time_model(args):
    """The KV shape of ``--model``, the prefill law and each tier's bandwidth
    and latency, from the flags (``--calibrate``, ``--prefill``,
    ``--storage-json``, ``--*-gbps``, ``--*-latency-ms``)."""
    from kvtier.bench.models import PRESETS
    from kvtier.bench.tinymodels import PRESETS as TINY
    from kvtier.plan.validate import model_shape

    if args.model not in PRESETS and args.model not in TINY:
        raise ConfigError("--model", f"unknown model preset {args.model!r}", f"use one of: {', '.join([*PRESETS, *TINY])}")
    model = model_shape(args.model)
    io = dict(cost.DEFAULT_IO)
    if args.storage_json:
        io = cost.io_from_storage_json(args.storage_json, io)
    prefill = cost.PrefillModel()
    if args.calibrate:
        from kvtier.plan import validate

        cal = Path(args.calibrate)
        if cal.suffix == ".jsonl" or (cal.is_dir() and any((d / "requests.jsonl").is_file() for d in (cal, cal / "report"))):
            prefill, io = validate.calibrate_run(cal, io)  # the law, and each tier's latency on hits
        else:
            prefill = cost.fit_prefill(cost.calibration_samples(cal))
        prefill = cost.PrefillModel(prefill.a, prefill.b, prefill.c, f"fitted to {args.calibrate}")
    for t in ("memory", "disk", "shared"):
        gbps, lat = getattr(args, f"{t}_gbps"), getattr(args, f"{t}_latency_ms")
        io[t] = cost.TierIO(gbps if gbps else io[t].gbps, lat / 1000 if lat is not None else io[t].latency_s)
    if args.prefill:
        prefill = parse_prefill(args.prefill)
    return model, prefill, io


def parse_prefill(text: str) -> cost.PrefillModel:
    """``--prefill a,b,c``."""
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError("--prefill", f"expected a,b,c, got {text!r}", "write e.g. --prefill 2e-3,2.5e-7,0.02") from None
    return cost.PrefillModel(a, b, c, "--prefill")


def step_overhead(args, prefill: cost.PrefillModel) -> float:
    """``--step-overhead-ms``, or the prefill law's per-request constant."""
    if args.step_overhead_ms is None:
        return prefill.c
    if args.step_overhead_ms < 0:
        raise ConfigError("--step-overhead-ms", f"must be 0 or more, got {args.step_overhead_ms}", "pass e.g. 20")
    return args.step_overhead_ms / 1000
