"""Many sessions returning at once: ``kvtier bench resume --concurrency``.

The reference experiment is a sweep: 8, 16, 32 long-context sessions come
back together and every configuration is judged by its TTFT percentiles and
its throughput at each level. This module measures what the device gives
that many streams, turns the engine runs of ``resume.py`` into those
figures, and sets each against its floor.

**The device.** Before any engine runs, fio reads the storage under the
stores with as many streams as each level has sessions (O_DIRECT, 1 MiB
blocks, 8 in flight per stream): the aggregate rate that many concurrent
loads could get. The best of them is the device's full rate; the modelled
local drive (``kvtier-local-drive``, blkio.py) is throttled to
``local_ratio`` of it.

**The floor at a level of c sessions.** Each session's load reads B bytes
(what kvtier read per request in that burst). At the device's full rate R
one load takes L = B / R. The engine's own work for a resume, S, is the
TTFT of a resume whose KV is already in the engine (the workload's last
phase, same engine run). If loads ran one after another at the full rate
(the best order: sharing the device finishes every load at the end of the
burst) and the engine computed each suffix as soon as its load ended, one
at a time, the k-th session would see its first token at

    floor_k = L + S + (k - 1) * max(L, S)        (k = 1 .. c)

(a two-stage pipeline: the device, then the engine). The floor's
percentiles are those of floor_1 .. floor_c. An engine that batches several
suffixes into one step can come in under it where S > L.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kvtier.bench.resume_report import pct, pyplot, write_summary

BARS = {
    "over_floor": 1.2,            # kvtier-shared TTFT p50 / floor p50 at the largest level, at most
    "throughput_vs_recompute": 5.0,  # kvtier-shared output tokens/s / recompute's at the largest level, at least
    "throttled_p50": 1.05,        # kvtier on storage slower than prefill / recompute, TTFT p50, at most
    "throttled_p99": 1.2,         # and p99, at most
}
FIO_DEPTH = 8


def measure_device(cfg, log=print) -> dict:
    """fio at each level's number of streams on the stores' file system, and
    the local drive's throttle from the best of them."""
    from kvtier.bench.blkio import why_not
    from kvtier.bench.fio import FioMissing, fio_seq_read_run, remove_fio_file

    where = cfg.workdir / "stores"
    where.mkdir(parents=True, exist_ok=True)
    out: dict = {"depth": FIO_DEPTH, "gbps_by_streams": {}}
    probe = where / "fio"
    try:
        for c in sorted(set(cfg.concurrency)):
            size = min(2 << 30, max(512 << 20, c * (128 << 20)))
            out["gbps_by_streams"][str(c)] = fio_seq_read_run(probe, FIO_DEPTH, size, jobs=c).gbps
    except (FioMissing, RuntimeError, OSError) as exc:
        log(f"fio skipped: {exc}")
        out["skipped"] = str(exc)
    finally:
        remove_fio_file(probe)
    reason = why_not(where)
    if cfg.device_bps:
        if reason:
            raise RuntimeError(f"--device-rate: {reason}")
        # The modelled device: what fio measured, held to the throttle's rate.
        out["modelled_gbps"] = cfg.device_bps / 1e9
        out["gbps_by_streams"] = {c: min(g, out["modelled_gbps"]) for c, g in out["gbps_by_streams"].items()}
    rates = out["gbps_by_streams"].values()
    out["best_gbps"] = max(rates) if rates else None
    if not reason and not out["best_gbps"]:
        reason = "fio did not measure the device, so there is no rate to model the local drive at"
    if reason:
        out["local_drive_skipped"] = reason
    else:
        out["local_drive_bps"] = cfg.local_ratio * out["best_gbps"] * 1e9
    return out


def floor(load_s: float, engine_s: float, c: int) -> list[float]:
    """Each of ``c`` sessions' first-token time in the best order: loads of
    ``load_s`` one after another, then the engine's ``engine_s`` each."""
    return [load_s + engine_s + k * max(load_s, engine_s) for k in range(c)]


def _delta(after: dict, before: dict, prefix: str) -> float:
    return sum(v for k, v in after.items() if k.startswith(prefix)) - sum(
        v for k, v in before.items() if k.startswith(prefix))


def _level(runs: list[dict], phase: str, before: str | None) -> dict:
    """One configuration's figures at one burst, over its rounds."""
    recs = [rec for r in runs for rec in r["records"] if rec["phase"] == phase]
    ttft = [rec["ttft_s"] for rec in recs]
    p50s, tok_s, req_s, read_gbps, hits_kv, hits_vllm, read_bytes = [], [], [], [], 0.0, 0.0, 0.0
    failed_blocks = stopped = 0.0
    for r in runs:
        mine = [rec for rec in r["records"] if rec["phase"] == phase]
        if not mine:
            continue
        p50s.append(pct([rec["ttft_s"] for rec in mine], 0.5))
        # From the first request sent to the last one done.
        span = max(rec["t_done"] for rec in mine) - min(rec["t_send"] for rec in mine)
        if span > 0:
            tok_s.append(sum(rec["output_tokens"] for rec in mine) / span)
            req_s.append(len(mine) / span)
        pm = r.get("phase_metrics", {})
        after = pm.get(phase, {})
        prev = pm.get(before, {}) if before else {}
        kv_a, kv_b = after.get("kvtier", {}), prev.get("kvtier", {})
        nbytes = _delta(kv_a, kv_b, "kvtier_read_bytes_total")
        busy = _delta(kv_a, kv_b, "kvtier_vllm_load_busy_seconds_total")
        read_bytes += nbytes
        if nbytes and busy > 0:
            read_gbps.append(nbytes / busy / 1e9)
        hits_kv += _delta(kv_a, kv_b, "kvtier_vllm_external_hit_tokens_total")
        failed_blocks += _delta(kv_a, kv_b, "kvtier_vllm_load_failed_blocks_total")
        stopped += _delta(kv_a, kv_b, "kvtier_vllm_stopped_loads_total")
        hits_vllm += _delta(after.get("vllm", {}), prev.get("vllm", {}), "vllm:external_prefix_cache_hits")
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {
        "requests": len(recs), "ttft_s": ttft,
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "ttft_p99_s": pct(ttft, 0.99),
        "ttft_p50_rounds_s": p50s, "ttft_p50_median_s": med(p50s),
        "output_tokens_per_s": med(tok_s), "requests_per_s": med(req_s), "output_tokens_per_s_rounds": tok_s,
        "read_gbps": med(read_gbps), "read_bytes_per_request": read_bytes / len(recs) if recs else 0.0,
        "hit_tokens": hits_kv, "vllm_external_prefix_cache_hits": hits_vllm,
        "cached_tokens": sum(rec["cached_tokens"] for rec in recs),
        # Loads cut short: stopped past their budget, or blocks that failed
        # to load; either way vLLM recomputed what was missing.
        "stopped_loads": stopped, "failed_blocks": failed_blocks,
    }


def summarise(cfg, runs: list[dict], device: dict, unavailable: dict, description: str = "") -> dict:
    from kvtier.bench.resume_report import _dtype

    levels = list(cfg.concurrency)
    results: dict = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        by: dict = {}
        for name in dict.fromkeys(r["config"] for r in runs if r["case"] == case):
            mine = [r for r in runs if r["case"] == case and r["config"] == name]
            engine = [rec["ttft_s"] for r in mine for rec in r["records"] if rec["phase"] == "engine"
                      and rec["cached_tokens"] > 0]
            per: dict = {}
            before = "warm" if any("warm" in r.get("phase_metrics", {}) for r in mine) else None
            for c in levels:
                per[str(c)] = _level(mine, f"c{c}", before)
                before = f"c{c}"
            by[name] = {"levels": per, "engine_s": statistics.median(engine) if engine else None}
        results[case] = by
        _floors(by, device, levels, cfg.local_ratio)
    summary = {
        "kind": "sweep", "workload": "W1", "model": cfg.model,
        "description": f"{description or 'concurrency sweep'}; {cfg.model} ({_dtype(cfg)})",
        "levels": levels, "contexts": [str(c) for c in cfg.contexts], "rounds": cfg.rounds,
        "answer_tokens": cfg.answer_tokens, "local_ratio": cfg.local_ratio, "device": device,
        "results": results, "unavailable": unavailable,
    }
    summary["checks"] = _checks(summary)
    return summary


def _floors(by: dict, device: dict, levels: list[int], ratio: float) -> None:
    """The floor of each kvtier configuration at each level, in place."""
    best = device.get("best_gbps")
    for name, v in by.items():
        rate = {"kvtier-shared": best, "kvtier-staged": best, "kvtier-shared-pairs": best, "kvtier-shared-fair": best,
                "kvtier-local-drive": best * ratio if best else None}.get(name.removesuffix("+mp"))
        s = v["engine_s"]
        for c in levels:
            lv = v["levels"][str(c)]
            b = lv["read_bytes_per_request"]
            if not rate or s is None or not b:
                continue
            load_s = b / (rate * 1e9)
            f = floor(load_s, s, c)
            lv["floor"] = {"load_s": load_s, "engine_s": s, "rate_gbps": rate,
                           "p50_s": pct(f, 0.5), "p90_s": pct(f, 0.9), "p99_s": pct(f, 0.99)}
            lv["over_floor"] = lv["ttft_p50_s"] / lv["floor"]["p50_s"]
            fio = device.get("gbps_by_streams", {}).get(str(c))
            if fio and lv["read_gbps"]:
                lv["read_vs_fio"] = lv["read_gbps"] / fio


def _checks(s: dict) -> dict:
    out: dict = {}
    top = str(max(s["levels"]))
    for case, by in s["results"].items():
        shared = by.get("kvtier-shared", {}).get("levels", {}).get(top)
        rec = by.get("recompute", {}).get("levels", {}).get(top)
        if shared and "over_floor" in shared:
            out[f"{case}: kvtier-shared TTFT p50 over the floor at {top}"] = {
                "value": shared["over_floor"], "bar": BARS["over_floor"], "met": shared["over_floor"] <= BARS["over_floor"]}
        if shared and rec and rec["output_tokens_per_s"] and shared["output_tokens_per_s"]:
            x = shared["output_tokens_per_s"] / rec["output_tokens_per_s"]
            out[f"{case}: kvtier-shared throughput over recompute's at {top}"] = {
                "value": x, "bar": BARS["throughput_vs_recompute"], "met": x >= BARS["throughput_vs_recompute"]}
        local = by.get("kvtier-local-drive", {}).get("levels", {}).get(top)
        if shared and local and "floor" in shared and "floor" in local:
            # The bandwidth's share alone: both floors with the shared run's engine time.
            fs, fl = shared["floor"], local["floor"]
            c = int(top)
            predicted = pct(floor(fl["load_s"], fs["engine_s"], c), 0.5) / fs["p50_s"]
            x = local["ttft_p50_s"] / shared["ttft_p50_s"]
            # Met when the measured ratio is the predicted one within 20 %:
            # the direction where the device bounds, ~1 where the engine does.
            out[f"{case}: local drive over shared, TTFT p50 at {top} (floor predicts {predicted:.2f})"] = {
                "value": x, "predicted": predicted, "bar": None, "met": abs(x - predicted) <= 0.2 * predicted}
        slow = by.get("kvtier-throttled", {}).get("levels", {})
        for c, lv in slow.items():
            base = by.get("recompute", {}).get("levels", {}).get(c)
            if not base:
                continue
            for q, bar in (("p50", BARS["throttled_p50"]), ("p99", BARS["throttled_p99"])):
                x = lv[f"ttft_{q}_s"] / base[f"ttft_{q}_s"]
                out[f"{case}: kvtier-throttled TTFT {q} over recompute's at {c}"] = {
                    "value": x, "bar": bar, "met": x <= bar}
        for name, v in by.items():
            bad = [c for c, lv in v["levels"].items() if lv["hit_tokens"] != lv["vllm_external_prefix_cache_hits"]]
            if name.startswith("kvtier"):
                out[f"{case}: {name} hit tokens equal vLLM's external hits at every level"] = {
                    "value": ", ".join(bad) or "all", "bar": None, "met": not bad}
    return out


# ------------------------------------------------------------------ report
def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _n(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(s: dict) -> str:
    lines = [f"{s['description']}; {s['rounds']} round(s), ABBA", ""]
    dev = s["device"]
    if dev.get("gbps_by_streams"):
        lines.append("device (fio, O_DIRECT 1 MiB x%d per stream): " % dev["depth"] + ", ".join(
            f"{c} streams {g:.2f} GB/s" for c, g in dev["gbps_by_streams"].items()))
    if dev.get("modelled_gbps"):
        lines.append(f"device: MODELLED, every kvtier configuration's reads held to {dev['modelled_gbps']:.2f} GB/s "
                     "by the kernel's block throttle (fio figures capped at it)")
    if dev.get("local_drive_bps"):
        lines.append(f"kvtier-local-drive: MODELLED, the same device held to {s['local_ratio']:.3f} x its best "
                     f"rate = {dev['local_drive_bps'] / 1e9:.2f} GB/s by the kernel's block throttle")
    for case, by in s["results"].items():
        names = list(by)
        lines += ["", f"context {case}: TTFT p50 / output tokens/s per configuration", ""]
        lines.append(f"{'sessions':>8}  " + "".join(f"{n:>26}" for n in names) + f"{'floor (shared)':>18}")
        for c in s["levels"]:
            row = f"{c:>8}  "
            for n in names:
                lv = by[n]["levels"][str(c)]
                row += f"{_s(lv['ttft_p50_s']) + ' / ' + _n(lv['output_tokens_per_s']):>26}"
            fl = by.get("kvtier-shared", {}).get("levels", {}).get(str(c), {}).get("floor")
            row += f"{_s(fl['p50_s']) if fl else '-':>18}"
            lines.append(row)
        lines += ["", f"{'configuration':<22}{'sessions':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'tok/s':>8}{'req/s':>7}"
                  f"{'read GB/s':>10}{'x fio':>7}{'floor p50':>10}{'/ floor':>8}{'hits':>9}{'vLLM':>9}"]
        for n in names:
            for c in s["levels"]:
                lv = by[n]["levels"][str(c)]
                fl = lv.get("floor")
                lines.append(
                    f"{n:<22}{c:>9}{lv['ttft_p50_s']:>9.2f}{lv['ttft_p90_s']:>9.2f}{lv['ttft_p99_s']:>9.2f}"
                    f"{_n(lv['output_tokens_per_s']):>8}{_n(lv['requests_per_s'], '.2f'):>7}"
                    f"{_n(lv['read_gbps'], '.2f'):>10}{_n(lv.get('read_vs_fio'), '.2f'):>7}"
                    f"{_n(fl['p50_s'] if fl else None, '.2f'):>10}{_n(lv.get('over_floor'), '.2f'):>8}"
                    f"{lv['hit_tokens']:>9.0f}{lv['vllm_external_prefix_cache_hits']:>9.0f}")
                if lv["stopped_loads"] or lv["failed_blocks"]:
                    lines.append(f"{'':<22}{c:>9}  loads stopped: {lv['stopped_loads']:.0f}, blocks recomputed "
                                 f"after a load: {lv['failed_blocks']:.0f}")
            if by[n]["engine_s"] is not None:
                lines.append(f"{'':<22}engine's own resume (KV already in the engine): {by[n]['engine_s']:.3f} s")
    if s.get("unavailable"):
        lines += ["", "not run on this host:"] + [f"  {n}: {why}" for n, why in s["unavailable"].items()]
    if s.get("checks"):
        lines += ["", "acceptance bars:"]
        for k, v in s["checks"].items():
            val = v["value"] if isinstance(v["value"], str) else f"{v['value']:.2f}"
            bar = f" (bar {v['bar']})" if v.get("bar") is not None else ""
            lines.append(f"  {k}: {val}{bar} {'met' if v['met'] else 'MISSED'}")
    lines += ["", "floor: loads one after another at the device's best fio rate, then the engine's own resume "
              "each (kvtier.bench.sweep); times are client-side, send to first token"]
    return "\n".join(lines)


def write_report(s: dict, out_dir: Path) -> list[Path]:
    return write_summary(s, out_dir, "sweep", format_table(s)) + _plot(s, out_dir)


def _plot(s: dict, out_dir: Path) -> list[Path]:
    """TTFT p50 (and the floor) and throughput against the number of sessions."""
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for case, by in s["results"].items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        levels = s["levels"]
        for n, v in by.items():
            ax1.plot(levels, [v["levels"][str(c)]["ttft_p50_s"] for c in levels], marker="o", label=n)
            ax2.plot(levels, [v["levels"][str(c)]["output_tokens_per_s"] or 0 for c in levels], marker="o", label=n)
        fl = [by.get("kvtier-shared", {}).get("levels", {}).get(str(c), {}).get("floor") for c in levels]
        if all(fl):
            ax1.plot(levels, [f["p50_s"] for f in fl], linestyle="--", color="grey", label="floor (shared)")
        ax1.set(xlabel="sessions returning at once", ylabel="TTFT p50 (s)", yscale="log", title=f"{case} tokens")
        ax2.set(xlabel="sessions returning at once", ylabel="output tokens/s", title="throughput")
        for ax in (ax1, ax2):
            ax.set_xticks(levels)
            ax.grid(alpha=0.3)
        ax1.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"sweep-{case}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
