"""``kvtier bench storage``'s report on a directory: the figures derived
from a run's measurements (kvtier's CPU per GB against fio's, each judged
by its cheapest variant at speed; what of it is the checksum and the copy;
what the store adds around the native read loop; what a cluster key adds;
the window to configure) and the table. It names the fio jobs whose rows
it labels; ``storage`` runs them under these names.
"""

from __future__ import annotations

from kvtier.bench.storage_common import (
    GiB,
    MiB,
    AUTH_MODES,
    AUTH_SUFFIX,
    FETCH_MODES,
    NO_COPY_MODES,
    fio_mode,
)
from kvtier.tiers.dir.filetier import FileTierConfig

# fio's buffered job over files of kvtier's object size.
OBJECT_FILES_JOB = "buffered-128k-object-files"
# fio's O_DIRECT reads of kvtier's own object files where they lie, one
# request per object, this many at once (a 2k session's objects).
OWN_OBJECTS_JOB = "direct-own-objects"
OWN_OBJECTS_DEPTH = 8
HUGE_SUFFIX = "-huge"  # fio's O_DIRECT jobs with their buffers on huge pages: "qd8-huge"
# The CPU per GB each side is judged by: its cheapest variant (fio's job in
# the read mode; kvtier's window and read mode) that reads within this
# fraction of its fastest (``cpu_comparison``).
CPU_REF_SPREAD = 0.10


def auth_cost(r: dict) -> dict:
    """Each mode with a key against the same mode without one, at each
    window measured with both: the CPU per GB the seal checks add, and
    each one's cold-load rate against fio's best job."""
    rows = {}
    for label, v in r["cold"].items():
        if v["read_mode"] not in AUTH_MODES:
            continue
        plain = next((p for p in r["cold"].values() if p["window_bytes"] == v["window_bytes"]
                      and p["read_mode"] == v["read_mode"][: -len(AUTH_SUFFIX)]), None)
        rows[label] = {
            "read_mode": v["read_mode"], "window_bytes": v["window_bytes"],
            "cpu_s_per_gb": v["cpu_s_per_gb"], "vs_fio": v["median_gbps"] / r["fio_best_gbps"],
            **({"plain_cpu_s_per_gb": plain["cpu_s_per_gb"], "plain_vs_fio": plain["median_gbps"] / r["fio_best_gbps"],
                "added_cpu_s_per_gb": v["cpu_s_per_gb"] - plain["cpu_s_per_gb"]} if plain else {}),
        }
    return {"auth": rows} if rows else {}


def cpu_floor(r: dict) -> dict:
    """What of kvtier's CPU per GB (its cold load at speed, as
    ``cpu_comparison`` picks it) is not the read machinery, measured on
    the same bytes in the same run: the payload's XXH3-128
    checksum, which every verified load pays, and the copy into the caller's
    own buffers, which a load into lent buffers or through ``fetch`` does
    not (read in place). The rest is the read machinery (lookups, opens,
    system calls, hand-offs), which is what fio's figure compares with."""
    copies = r["cold"][r["cold_cpu_variant"]]["read_mode"] not in NO_COPY_MODES
    floor = r["checksum_cpu_s_per_gb"] + (r["copy_cpu_s_per_gb"] if copies else 0.0)
    rest = max(0.0, r["cold_cpu_s_per_gb"] - floor)
    fio = r["fio_cpu_s_per_gb"]
    return {
        "cpu_floor_s_per_gb": floor,
        "cpu_floor_copies": copies,
        "cpu_machinery_s_per_gb": rest,
        "machinery_vs_fio": rest / fio if fio > 0 else float("nan"),
    }


def _where_read(r: dict) -> str:
    """Where the variant judged for CPU read its objects in place."""
    return "the tier's buffers (fetch)" if r["cold"][r["cold_cpu_variant"]]["read_mode"] in FETCH_MODES \
        else "lent buffers"


def store_cost(r: dict) -> dict:
    """kvtier's cold load (the variant ``cpu_comparison`` picks) against
    the native read loop alone at the same window, on the same objects in
    the same run: what the store's own bookkeeping adds to a verified read
    (its plan, its read stream, each object's header, latency, recency
    stamp and buffer, the hand-off of the loop to a pool thread).
    Only where that variant's loads ran the native loop into lent buffers
    or, through ``fetch``, into the tier's own: other read modes are other
    machinery (a copy, or the Python driver)."""
    chosen = r["cold"][r["cold_cpu_variant"]]
    alone = next((v for v in r.get("loop_alone", {}).values() if v["window_bytes"] == chosen["window_bytes"]), None)
    if alone is None or chosen["read_mode"] not in NO_COPY_MODES or not chosen["loads_by_driver"].get("native"):
        return {}
    kv, loop = r["cold_cpu_s_per_gb"], alone["cpu_s_per_gb"]
    return {
        "loop_alone_cpu_s_per_gb": loop,
        "loop_alone_cpu_vs_fio": loop / r["fio_cpu_s_per_gb"] if r["fio_cpu_s_per_gb"] > 0 else float("nan"),
        "store_cpu_s_per_gb": max(0.0, kv - loop),
        "store_cpu_share": max(0.0, kv - loop) / kv if kv > 0 else float("nan"),
    }


def cpu_comparison(r: dict) -> dict:
    """CPU seconds per GB read by kvtier at its speed against what fio
    spends to read at the device's speed, each side judged alike: by its
    cheapest variant within ``CPU_REF_SPREAD`` of its fastest (kvtier's
    windows and read modes; fio's jobs in the read mode of kvtier's, O_DIRECT
    or buffered, any mode if fio ran none in it). Which of the variants
    that read at about one rate is fastest is the noise of the run, and
    their CPU is not: fio's qd1 costs more than qd8 (it waits once per
    request), and kvtier's windows differ too; held against fio's fastest
    job, the ratio would swing between runs of the same code
    (docs/benchmarks.md). Both are user + system time of the reading process(es):
    kvtier's whole process (every thread) from getrusage, fio's jobs from
    fio's own accounting. The CPU of kvtier's fastest variant is kept too
    (``cold_best_cpu_s_per_gb``)."""
    at = _cheapest_at_speed(r["cold"], list(r["cold"]))
    mode = fio_mode(r["cold"][at]["read_mode"])
    kv = r["cold"][at]["cpu_s_per_gb"]
    ref = _cpu_reference(r["fio"], mode)
    fio = r["fio"][ref]["cpu_s_per_gb"]
    out = {
        "cold_cpu_variant": at,
        # The window to configure on this storage (``read_window_bytes``): the
        # one that read at about the fastest rate for the least CPU.
        "suggested_read_window_bytes": r["cold"][at].get("window_bytes"),
        "cold_cpu_s_per_gb": kv,
        "cold_best_cpu_s_per_gb": r["cold"][r["cold_best_window"]]["cpu_s_per_gb"],
        "fio_cpu_job": ref,
        "fio_cpu_s_per_gb": fio,
        "cpu_vs_fio": kv / fio if fio > 0 else float("nan"),
    }
    if any(v.get("huge_pages") for v in r["fio"].values()):
        # Also against fio's jobs on its default buffers alone (what runs
        # without reserved huge pages).
        small = {j: v for j, v in r["fio"].items() if not v.get("huge_pages")}
        ref4k = _cpu_reference(small, mode)
        fio4k = small[ref4k]["cpu_s_per_gb"]
        out.update({"fio_cpu_job_4k_pages": ref4k, "fio_cpu_s_per_gb_4k_pages": fio4k,
                    "cpu_vs_fio_4k_pages": kv / fio4k if fio4k > 0 else float("nan")})
    return out


def window_advice(r: dict) -> str:
    """The report's line on ``read_window_bytes``: the window of kvtier's
    cheapest variant at its speed, and how to check it end to end (in vLLM
    the engine holds objects longer than these loads do, so a window that
    pays here may not pay there: docs/benchmarks.md)."""
    from kvtier.bench.resume_configs import READ_PATHS  # its configurations' names; not needed at start-up

    w, default = r["suggested_read_window_bytes"], FileTierConfig().read_window_bytes
    mode = r["cold"][r["cold_cpu_variant"]]["read_mode"]
    path = " with o_direct: false" if mode == "buffered" else ""
    if w == default:
        return (f"  read_window_bytes: the tiers' default, {w // MiB}MiB, read at about the fastest rate for the least "
                f"CPU in these loads{path}")
    line = (f"  read_window_bytes: {w // MiB}MiB{path} read at about the fastest rate for the least CPU in these loads "
            f"(the tiers' default: {default // MiB}MiB)")
    if mode != "buffered" and f"kvtier-shared-w{w // MiB}" in READ_PATHS:
        line += f"; check it end to end before setting it: kvtier bench resume --configs kvtier-shared,kvtier-shared-w{w // MiB}"
    return line


def _cpu_reference(jobs: dict, mode: str) -> str:
    """Of fio's ``jobs``, the one kvtier's CPU is held against: the cheapest
    within ``CPU_REF_SPREAD`` of the fastest in read ``mode`` (any mode if
    none ran in it)."""
    return _cheapest_at_speed(jobs, [j for j, v in jobs.items() if v["read_mode"] == mode] or list(jobs))


def _cheapest_at_speed(rows: dict, names: list[str]) -> str:
    """Of ``names`` (keys of ``rows``, each with ``median_gbps`` and
    ``cpu_s_per_gb``), the cheapest per GB of those within ``CPU_REF_SPREAD``
    of the fastest."""
    fastest = max(rows[n]["median_gbps"] for n in names)
    at_speed = [n for n in names if rows[n]["median_gbps"] >= (1 - CPU_REF_SPREAD) * fastest]
    return min(at_speed, key=lambda n: rows[n]["cpu_s_per_gb"])


def _kib(v: float | None) -> str:
    """A request size for the table: KiB below 1 MiB, else MiB; blank if unknown."""
    if not v:
        return f"{'':>9}"
    return f"{v:>5.0f} KiB" if v < 1024 else f"{v / 1024:>5.2f} MiB"


def format_table(r: dict) -> str:
    if "tier" in r:
        from kvtier.bench import storage_remote

        return storage_remote.format_table(r)
    fio_best = r["fio_best_gbps"]
    # The first column fits the longest label (read modes' names vary).
    width = max(44, *(len("kvtier cold load, window " + w) + 2 for w in r["cold"]))
    lines = [
        f"kvtier bench storage  {r['directory']} ({r['filesystem']})",
        f"data: {r['data_bytes'] / GiB:.2f} GiB in {r['chunks']} chunks of {r['chunk_bytes'] / MiB:.2f} MiB "
        f"({r['model']['name']}, {r['chunk_tokens']} tokens/chunk, {r['sessions']} sessions); "
        f"medians of {r['repeats']} runs",
        "",
        f"{'measurement':<{width}}{'GB/s':>8}  {'ratio':>18}  {'CPU s/GB':>9}  {'request':>9}",
        "-" * (width + 50),
    ]
    def row(what: str, v: dict, mark: str = "") -> str:
        return (f"{what:<{width}}{v['median_gbps']:>8.2f}  {v['median_gbps'] / fio_best:>12.2f} x fio  "
                f"{v['cpu_s_per_gb']:>9.3f}  {_kib(v.get('request_kib'))}{mark}")

    for job, v in r["fio"].items():
        if job == OWN_OBJECTS_JOB:
            what = f"fio O_DIRECT kvtier's own objects qd{OWN_OBJECTS_DEPTH}" + (", huge pages" if v["huge_pages"] else "")
        elif job == OBJECT_FILES_JOB:
            what = f"fio same, files of {r['object_bytes'] / MiB:.2f}MiB"
        elif job.startswith("buffered"):
            what = f"fio seq read buffered 128KiB x{r.get('fio_streams', 1)}"
        elif job.endswith(HUGE_SUFFIX):
            what = f"fio seq read O_DIRECT 1MiB {job[: -len(HUGE_SUFFIX)]}, huge pages"
        else:
            what = "fio seq read O_DIRECT 1MiB " + job
        lines.append(row(what, v))
    if "burst" in r:
        lines.append(row("device, one load at once, no checks", r["burst"]))
    for w, v in r.get("loop_alone", {}).items():
        lines.append(row("native read loop alone, window " + w, v))
    for w, v in r["cold"].items():
        lines.append(row("kvtier cold load, window " + w, v, " *" if w == r["cold_best_window"] else ""))
    stopped = [w for w, v in r["cold"].items() if v.get("aio_stopped")]
    if stopped:
        lines.append(f"  {', '.join(stopped)}: moved to pool threads during the run (its AIO loads spent most of "
                     "their time opening files, one at a time: each open a round trip here); what the default "
                     "configuration does on this mount")
    drivers = [f"{w} " + "/".join(f"{d} {n}" for d, n in v["loads_by_driver"].items() if n)
               for w, v in r["cold"].items() if any(v.get("loads_by_driver", {}).values())]
    if drivers:
        lines.append(f"  loads by driver (native read loop, Python AIO driver, pool threads): {'; '.join(drivers)}")
    auto = [f"{v['window_bytes'] // MiB}MiB {v['loads_by_path']['direct']}/{v['loads_by_path']['buffered']}"
            for v in r["cold"].values() if v["read_mode"] == "auto" and "loads_by_path" in v]
    if auto:
        lines.append(f"  auto: loads read O_DIRECT/buffered, by window: {', '.join(auto)}")
    if any(v.get("request_kib") for v in [*r["fio"].values(), *r["cold"].values()]):
        lines.append("  request: the mean read request the block device completed during the run")
    idle = [(w, v["idle_ms"]) for w, v in r["cold"].items() if v.get("idle_ms")]
    if idle:
        lines.append("  nothing in flight during a load (medians, ms): at its start / between reads / after its last "
                     "read, of the load")
        for w, i in idle:
            lines.append(f"    {w:<40}{i['start']:>6.1f} /{i['between']:>6.1f} /{i['tail']:>6.1f}   of {i['load']:.1f}")
    lines.append(f"{'memcpy (same bytes)':<{width}}{r['memcpy_gbps']:>8.2f}")
    lines.append(
        f"{'kvtier memory-tier load':<{width}}{r['memory_load_gbps']:>8.2f}  {r['memory_vs_memcpy']:>9.2f} x memcpy"
    )
    lines.append("")
    lines.append(
        f"cold load (best window {r['cold_best_window']}) = {r['cold_vs_fio']:.2f} x best fio; "
        f"memory load = {r['memory_vs_memcpy']:.2f} x memcpy"
    )
    if "cold_vs_object_files" in r:
        lines.append(
            f"fio itself over files of kvtier's object size: {r['object_files_vs_fio']:.2f} x best fio "
            f"(the ceiling of one file per object); kvtier's cold load = {r['cold_vs_object_files']:.2f} x that"
        )
    if "cold_vs_own_objects" in r:
        lines.append(
            f"fio reading kvtier's own object files where they lie (O_DIRECT, one request per object, "
            f"{OWN_OBJECTS_DEPTH} at once): {r['own_objects_vs_fio']:.2f} x best fio (the device for these very "
            f"bytes); kvtier's cold load = {r['cold_vs_own_objects']:.2f} x that"
        )
        if r.get("own_objects_huge_skipped"):
            lines.append(f"  its buffers on 4 KiB pages ({r['own_objects_huge_skipped']})")
    elif r.get("own_objects_skipped"):
        lines.append(f"fio reading kvtier's own object files: not run ({r['own_objects_skipped']})")
    if "cold_vs_burst" in r:
        lines.append(
            f"the device reading one load's {r['session_chunks']} objects at once, nothing checked: "
            f"{r['burst_vs_fio']:.2f} x best fio (the ceiling of a load this size); "
            f"kvtier's cold load = {r['cold_vs_burst']:.2f} x that"
        )
    elif r.get("burst_skipped"):
        lines.append(f"the device reading one load's objects at once: not measured ({r['burst_skipped']})")
    kv = r["cold_cpu_s_per_gb"]
    fastest = "" if r["cold_cpu_variant"] == r["cold_best_window"] else \
        f"; its fastest, {r['cold_best_window']}, {r['cold_best_cpu_s_per_gb']:.3f} s"
    lines.append(
        f"CPU per GB read (user + system): kvtier {kv:.3f} s ({r['cold_cpu_variant']}: its cheapest variant within "
        f"{CPU_REF_SPREAD:.0%} of its fastest{fastest}), fio {r['fio_cpu_s_per_gb']:.3f} s "
        f"({r['fio_cpu_job']}: its cheapest job within {CPU_REF_SPREAD:.0%} of its fastest in that read mode) "
        f"= {r['cpu_vs_fio']:.2f} x fio; kvtier's cost is "
        f"{kv * 10:.1f} cores at 10 GB/s, {kv * 50:.1f} at 50 GB/s"
    )
    for label, a in r.get("auth", {}).items():
        if "plain_cpu_s_per_gb" in a:
            lines.append(
                f"with a cluster key ({label}): cold load {a['vs_fio']:.2f} x best fio, {a['cpu_s_per_gb']:.3f} s CPU "
                f"per GB; without one ({a['read_mode'][: -len(AUTH_SUFFIX)]}, same window): {a['plain_vs_fio']:.2f} x, "
                f"{a['plain_cpu_s_per_gb']:.3f} s: the seal checks add {a['added_cpu_s_per_gb']:+.3f} s per GB")
        else:
            lines.append(f"with a cluster key ({label}): cold load {a['vs_fio']:.2f} x best fio, "
                         f"{a['cpu_s_per_gb']:.3f} s CPU per GB")
    chosen = r["cold"][r["cold_cpu_variant"]]
    if r.get("suggested_read_window_bytes"):
        lines.append(window_advice(r))
    if "metrics_cpu_s_per_gb" in chosen:
        lines.append(
            f"  kvtier's own metrics (kvtier_io_cpu_seconds{{kind=\"load\"}} + kvtier_load_caller_cpu_seconds, what "
            f"an operator scrapes in service) counted {chosen['metrics_cpu_s_per_gb']:.3f} s of it over all repeats, "
            f"{chosen['metrics_cpu_share']:.0%} of the process's over the same loads"
        )
    if "cpu_vs_fio_4k_pages" in r:
        lines.append(
            f"  against fio's buffers on 4 KiB pages (its default, without the huge-page jobs): fio "
            f"{r['fio_cpu_s_per_gb_4k_pages']:.3f} s ({r['fio_cpu_job_4k_pages']}) = {r['cpu_vs_fio_4k_pages']:.2f} x fio"
        )
    elif r.get("fio_huge_skipped"):
        lines.append(f"  fio with its buffers on huge pages, as kvtier's are: not run ({r['fio_huge_skipped']})")
    if "cpu_floor_s_per_gb" in r:
        copy = (f"copy into the caller's buffers {r['copy_cpu_s_per_gb']:.3f}, " if r.get("cpu_floor_copies", True)
                else f"no copy: read in place into {_where_read(r)}, a copy would be {r['copy_cpu_s_per_gb']:.3f}; ")
        lines.append(
            f"  of which {r['cpu_floor_s_per_gb']:.3f} s is not the read machinery ({copy}"
            f"XXH3 checksum {r['checksum_cpu_s_per_gb']:.3f}, same bytes); "
            f"the read machinery {r['cpu_machinery_s_per_gb']:.3f} s = {r['machinery_vs_fio']:.2f} x fio"
        )
    if "burst" in r and "cpu_floor_s_per_gb" in r:
        floor = r["burst"]["cpu_s_per_gb"] + r["checksum_cpu_s_per_gb"]
        lines.append(
            f"  a verified read's floor here: the kernel's part (the device line's CPU) {r['burst']['cpu_s_per_gb']:.3f} s "
            f"+ XXH3 {r['checksum_cpu_s_per_gb']:.3f} s = {floor:.3f} s = {floor / r['fio_cpu_s_per_gb']:.2f} x fio; "
            f"kvtier spends {max(0.0, kv - floor):.3f} s more"
        )
    if "store_cpu_s_per_gb" in r:
        w = r["cold"][r["cold_cpu_variant"]]["window_bytes"] // MiB
        lines.append(
            f"  the native read loop alone at the same window ({w}MiB: open, read, verify; no store around it) "
            f"{r['loop_alone_cpu_s_per_gb']:.3f} s = {r['loop_alone_cpu_vs_fio']:.2f} x fio; the store's bookkeeping "
            f"around it (plan, read stream, each object's header, latency, recency stamp and buffer, the "
            f"hand-off to a pool thread) {r['store_cpu_s_per_gb']:.3f} s, {r['store_cpu_share']:.0%} of kvtier's"
        )
    elif r.get("loop_alone_skipped"):
        lines.append(f"  the native read loop alone: not measured ({r['loop_alone_skipped']})")
    return "\n".join(lines)
