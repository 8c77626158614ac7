"""The soak's verdict: each answer of the soak engine against the
reference's, the faults injected and what kvtier counted, in one report
(``judge``), and its text (``format_report``)."""

from __future__ import annotations

import json

REFERENCES = {
    "engine": "a separate engine, kvtier and prefix cache off",
    "salted": "the same engine before any fault, a fresh cache salt per prompt",
}
MUST_BE_ZERO = ("wrong_requests", "off_logprob_requests", "failed_requests", "outside_changed")
LOGPROB_TOL = 1e-3  # as the end-to-end tests: same tokens, same top logprobs within this


def judge(stream: list[list[int]], expected: dict, out: dict, reference: str, tmpfs: list[str],
          seconds: float) -> dict:
    """The report of a soak: ``stream`` the prompts served in order,
    ``expected`` the reference's answer per prompt, ``out`` what the soak
    engine wrote. ``ok`` when every must-be-0 figure is 0 and every request
    was served."""
    wrong, off = [], []
    for i, (p, r) in enumerate(zip(stream, out["results"])):
        if r["error"] is None:
            exp = expected[tuple(p)]
            if r["tokens"] != exp["tokens"]:
                wrong.append(i)
            elif _logprob_gap(r["logprobs"], exp["logprobs"]) > LOGPROB_TOL:
                off.append(i)
    failed = [i for i, r in enumerate(out["results"]) if r["error"] is not None]
    km = out["kvtier_metrics"]
    report = {
        "reference": reference,
        "requests": len(stream),
        "served": len(out["results"]) - len(failed),
        "failed_requests": len(failed),
        "wrong_requests": len(wrong),
        "off_logprob_requests": len(off),
        "faults": out["faults"],
        "faults_total": sum(out["faults"].values()),
        "faults_skipped": out["skipped"],
        "outside_changed": len(out["outside_changed"]),
        "memory_drops": out["memory_drops"],
        "prompt_tokens": sum(len(p) for p in stream),
        "kvtier_hit_tokens": _sum(km, "kvtier_vllm_external_hit_tokens_total"),
        "kvtier_integrity_failures": _sum(km, "kvtier_integrity_failures_total"),
        "blocks_recomputed_after_failed_load": _sum(km, "kvtier_vllm_load_failed_blocks_total"),
        "dropped_saves": _sum(km, "kvtier_dropped_saves_total"),
        "backend_errors": _sum(km, "kvtier_errors_total"),
        "seconds": seconds,
        "details": {"wrong": wrong[:20], "off_logprobs": off[:20], "failed": [out["results"][i]["error"] for i in failed[:20]],
                    "outside_changed": out["outside_changed"][:20], "tmpfs": tmpfs},
    }
    report["ok"] = all(report[k] == 0 for k in MUST_BE_ZERO) and report["served"] == len(stream)
    return report


def _logprob_gap(got: list[dict], want: list[dict]) -> float:
    """The largest difference of a top logprob both runs report, any step."""
    gap = 0.0
    for g, w in zip(got, want):
        for tok in set(g) & set(w):
            gap = max(gap, abs(g[tok] - w[tok]))
    return gap


def _sum(metrics: dict, name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))

def format_report(r: dict) -> str:
    faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()) if v)
    lines = [
        "kvtier soak: resumed sessions in a real engine while its storage is damaged",
        "",
        f"requests served          {r['served']} of {r['requests']}",
        f"faults injected          {r['faults_total']} ({faults})",
    ]
    if r["faults_skipped"]:
        lines.append(f"faults skipped           {'; '.join(r['faults_skipped'])}")
    lines += [
        f"memory tier emptied      {r['memory_drops']} times",
        f"wrong tokens             {r['wrong_requests']} requests (must be 0)",
        f"logprobs off by > {LOGPROB_TOL:g}  {r['off_logprob_requests']} requests with the right tokens (must be 0)",
        f"failed requests          {r['failed_requests']} (must be 0)",
        f"changes outside store    {r['outside_changed']} (must be 0)",
        f"kvtier hit tokens        {r['kvtier_hit_tokens']:.0f} of {r['prompt_tokens']} prompt tokens",
        f"integrity failures       {r['kvtier_integrity_failures']:.0f} (counted, quarantined, recomputed)",
        f"blocks recomputed        {r['blocks_recomputed_after_failed_load']:.0f} (promised, then failed to load)",
        f"saves dropped            {r['dropped_saves']:.0f}",
        f"backend errors           {r['backend_errors']:.0f}",
        f"reference                {REFERENCES[r['reference']]}",
        f"time                     {r['seconds']:.0f} s",
        "",
        "OK" if r["ok"] else "FAILED: " + json.dumps(r["details"]),
    ]
    return "\n".join(lines)
