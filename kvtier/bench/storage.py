"""``kvtier bench storage``: how close kvtier's reads get to the storage limit.

On a network tier (``--tier redis://...``, ``s3://...``) see ``storage_remote``.
In one run, on one directory:
1. write ``size`` bytes of chunk objects shaped like a real model's KV
   (sessions of ``session_chunks`` chunks, prefix-chained keys);
2. fio sequential reads: O_DIRECT at several queue depths, and buffered
   128 KiB reads with the kernel's readahead in up to 16 streams (one file
   each, laid out and synced first, page cache dropped); the
   best of them is the storage limit; and fio's O_DIRECT reads of kvtier's
   own object files where they lie (hard links to the sessions' objects,
   one request per object): the device's rate for the very bytes the cold
   loads read;
3. the device's own rate for loads of one session's size: each session's
   object files read all at once with O_DIRECT and native AIO, nothing
   checked (``burst``): the ceiling of a load that size, and the kernel's
   part of its CPU;
4. the native read loop alone (``loopalone``) at each read window: each
   session's objects opened, read with O_DIRECT and verified by kvtier's
   native loop with no store around it: what a verified read costs
   without the store's bookkeeping;
5. kvtier cold loads (page cache dropped, parallel within a byte window) at
   several window sizes and in several read modes (O_DIRECT into buffers the
   store lends, read and verified in place; O_DIRECT and buffered into the
   caller's own buffers, copied into), through ``TieredStore.load`` as an
   engine would call it (lookup, verified reads), or through
   ``TieredStore.fetch`` as vLLM's worker does (each verified object
   handed over in the tier's own buffer, ``direct-aio-fetch``);
6. kvtier memory-tier loads against a plain memcpy of the same bytes.

Beside each fio job and cold load, the mean size of the read requests the
block device completed meanwhile (Linux's ``/sys/dev/block/M:m/stat``):
whether reads reached the device whole or cut into pieces.

Every figure is the median of ``repeats`` runs; ratios compare medians of the
same run. Steps 2-5 are interleaved: each repeat runs every fio job, the
burst, the loop alone and every cold load once, in the reverse order of the
repeat before. Nothing is cached between runs of step 5 (the files are
dropped from the page cache before each; the burst and the loop alone read
with O_DIRECT).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from kvtier import auth
from kvtier.buffers import align_up, alloc
from kvtier.codec import HEADER_BLOCK
from kvtier.config import StoreConfig, TierSpec
from kvtier.engine.store import TieredStore
from kvtier.bench.burst import Burst, why_not as burst_why_not
from kvtier.bench.loopalone import LoopAlone, why_not as loop_why_not
from kvtier.bench.fio import BUFFERED_STREAMS, fio_files_read, fio_seq_read_run, huge_pages_short, remove_fio_file
from kvtier.bench.storage_common import (
    GiB,
    MiB,
    AUTH_MODES,
    FETCH_MODES,
    LENT_MODES,
    READ_MODES,
    fio_mode,
    StorageBenchConfig,
    StorageBenchError,
    host,
    load_sessions,
    median,
    memory_bench,
    namespace,
    populate,
    sessions as make_sessions,
    summarize,
)
from kvtier.bench.storage_report import (
    HUGE_SUFFIX,
    OBJECT_FILES_JOB,
    OWN_OBJECTS_DEPTH,
    OWN_OBJECTS_JOB,
    auth_cost,
    cpu_comparison,
    cpu_floor,
    format_table,
    store_cost,
)
from kvtier import observe
from kvtier.bench.readtrace import ReadTrace, ReadTraces
from kvtier.progress import Progress, silent
from kvtier.tiers.shared import SharedConfig, SharedTier
from kvtier.version import __version__

# The CLI and callers take these from here.
__all__ = ["GiB", "MiB", "READ_MODES", "StorageBenchConfig", "StorageBenchError", "run", "format_table", "cold_label"]


# The device reading one load's objects at once (bench/burst.py).
BURST = "burst"
# The native read loop alone at a window (bench/loopalone.py): ("loop", window).
LOOP = "loop"
# Read modes whose loads go through the AIO driver (their reads are traced).
AIO_MODES = ("direct-aio", "direct-aio-lent", "direct-aio-lent-python", "direct-aio-4k", "direct-aio-fetch", *AUTH_MODES)
DRIVERS = ("native", "aio", "threads")  # kvtier_load_drivers_total's drivers


def _shared_spec(path: Path, capacity: int, window: int, threads: int, mode: str = "direct") -> TierSpec:
    return TierSpec(
        "shared",
        SharedConfig(
            path=str(path), capacity=capacity, name="shared", o_direct=fio_mode(mode) == "direct",
            aio=mode in ("auto", *AIO_MODES), adaptive_reads=mode == "auto",
            native_reads=mode != "direct-aio-lent-python",
            read_window_bytes=window, io_threads=threads, gc_interval_s=0,
        ),
    )


class DeviceReads:
    """Read requests completed by the block device that holds a directory,
    from ``/sys/dev/block/MAJOR:MINOR/stat`` (Linux; a partition counts its
    own). ``sample`` is None where there is no such file (tmpfs, overlay,
    another OS): the report then leaves request sizes out."""

    def __init__(self, path: Path):
        st = os.stat(path)
        self._stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")

    def sample(self) -> tuple[int, int] | None:
        """(read requests completed, 512-byte sectors read) so far."""
        try:
            fields = self._stat.read_text().split()
            return int(fields[0]), int(fields[2])
        except (OSError, ValueError, IndexError):
            return None

    @staticmethod
    def mean_kib(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
        """Mean read request in KiB between two samples (None without both,
        or without a request between them)."""
        if before is None or after is None or after[0] <= before[0]:
            return None
        return (after[1] - before[1]) * 512 / (after[0] - before[0]) / 1024


def _median_or_none(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return median(xs) if xs else None


def cold_label(window: int, mode: str) -> str:
    """The key of one cold-load variant in the results: "64MiB" (O_DIRECT)
    or "64MiB buffered"."""
    return f"{window // MiB}MiB" + ("" if mode == "direct" else f" {mode}")


def run(cfg: StorageBenchConfig, progress: Progress = silent) -> dict:
    if cfg.tier is not None:
        from kvtier.bench import storage_remote

        return storage_remote.run(cfg, progress)
    root = Path(cfg.directory)
    store_dir, fio_dir = root / "store", root / "fio"
    sessions = make_sessions(cfg, namespace(cfg))
    n_chunks = sum(len(s) for s in sessions)
    capacity = 4 * cfg.size_bytes + GiB
    result: dict = {
        "kvtier_version": __version__,
        "directory": str(root.resolve()),
        "host": host(),
        "model": asdict(cfg.model),
        "chunk_tokens": cfg.chunk_tokens,
        "chunk_bytes": cfg.model.bytes_per_token * cfg.chunk_tokens,
        "chunks": n_chunks,
        "sessions": len(sessions),
        "session_chunks": cfg.session_chunks,
        "repeats": cfg.repeats,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    # 1. data, sealed with the benchmark's own cluster key (kept beside the
    # store, so that a second run on it reads what the first wrote): the
    # modes with a key check the seals; the others do not look at them.
    t_start = t0 = time.perf_counter()
    store_dir.mkdir(parents=True, exist_ok=True)  # a shared tier's folder must exist, as a mount point does
    key_file = bench_key_file(root)
    writer_cfg = _shared_spec(store_dir, capacity, 64 * MiB, cfg.io_threads).config
    with SharedTier(writer_cfg) as writer:
        total_bytes = populate(writer, sessions, cfg, progress, str(writer.dir.root), auth.load_keyring(key_file))
        writer.drop_cache()
    result["data_bytes"] = total_bytes
    result["filesystem"] = _fs_type(store_dir)
    result["write_seconds"] = time.perf_counter() - t0

    # 2+3. fio and kvtier cold loads, interleaved repeat by repeat so that
    # both see the same device conditions (shared and virtual disks drift).
    fio_size = min(cfg.size_bytes, 2 * GiB)
    bufs = [alloc(cfg.model.bytes_per_token * cfg.chunk_tokens) for _ in range(cfg.session_chunks)]
    # fio: O_DIRECT at each depth, and buffered 128 KiB reads (readahead) in
    # as many streams as kvtier reads objects at once (its I/O threads).
    streams = min(cfg.io_threads, BUFFERED_STREAMS)
    fio_jobs = {f"qd{d}": (d, "1M", True, 1, 0, False) for d in cfg.fio_depths}
    # The same O_DIRECT jobs with fio's buffers on huge pages, as kvtier's
    # are, where the host reserved enough (vm.nr_hugepages): on 4 KiB pages
    # each read pins every page, which may cost fio more than the device.
    huge, result["fio_huge_skipped"] = _huge_jobs(cfg.fio_depths)
    fio_jobs.update(huge)
    object_bytes = HEADER_BLOCK + align_up(result["chunk_bytes"])
    # Whatever read modes of kvtier's are measured: fio's best job is the
    # device's best, the figure every cold load is held against.
    fio_jobs["buffered-128k"] = (1, "128k", False, streams, 0, False)
    # The same job over files of kvtier's object size: what a layout of one
    # file per object allows the device, with no kvtier code in the way (each
    # file's readahead starts small and ends with the file).
    fio_jobs[OBJECT_FILES_JOB] = (1, "128k", False, streams, object_bytes, False)
    fio_runs: dict[str, list] = {j: [] for j in fio_jobs}
    device = DeviceReads(store_dir)
    variants = [(w, m) for m in cfg.read_modes for w in cfg.windows]
    requests: dict = {k: [] for k in [*fio_jobs, *variants, BURST]}  # mean request KiB per run, by measurement
    cold_runs: dict[tuple, list] = {v: [] for v in variants}
    per_load: dict[tuple, list[float]] = {v: [] for v in variants}
    stores = {
        (w, m): TieredStore(StoreConfig(tiers=(_shared_spec(store_dir, capacity, w, cfg.io_threads, m),), promote=False,
                                        huge_pages=m != "direct-aio-4k", auth_key_file=key_file if m in AUTH_MODES else ""))
        for w, m in variants
    }
    # What each variant loads into: buffers its store lends, the caller's
    # own, or none (objects taken from ``fetch`` in the tier's buffers).
    into = {v: stores[v].load_buffers(cfg.session_chunks, result["chunk_bytes"]) if v[1] in LENT_MODES
            else None if v[1] in FETCH_MODES else bufs
            for v in variants}
    # Where the AIO path's loads had nothing in flight (start, between reads, tail).
    # The AIO streams report their reads to ``recorder`` while it is installed.
    recorder = ReadTraces()
    traces = {v: recorder.watch(stores[v].tier("shared")) for v in variants if v[1] in AIO_MODES}
    # The device's own rate for one load's objects at once (bench/burst.py),
    # where the store's files open with O_DIRECT and the kernel has AIO.
    odir = next(iter(stores.values())).tier("shared").dir
    burst_skipped = burst_why_not() or ("" if odir.direct_ok else "the file system refuses O_DIRECT")
    burst = None if burst_skipped else Burst([[str(odir.path(k)) for k in keys] for keys in sessions],
                                             object_bytes, result["chunk_bytes"])
    burst_runs: list = []
    # The native read loop with no store around it, at each window
    # (bench/loopalone.py): the verified read without the store's bookkeeping.
    loop_skipped = loop_why_not() or ("" if odir.direct_ok else "the file system refuses O_DIRECT")
    loop = None if loop_skipped else LoopAlone(odir.base, [[odir.rel_path(k) for k in keys] for keys in sessions],
                                               object_bytes, result["chunk_bytes"])
    loop_runs: dict[int, list] = {w: [] for w in cfg.windows} if loop is not None else {}
    for w in loop_runs:
        requests[LOOP, w] = []
    # fio over kvtier's own object files, as they lie: the device's rate for
    # the very bytes the cold loads read, where fio's freshly laid-out files
    # may lie elsewhere (a disk's speed may differ by region). Hard links in
    # fio's folder give fio exactly the sessions' objects (one --opendir; a
    # list of names is too long for fio).
    own_dir = fio_dir / "kvtier-own-objects"
    own_huge_short = huge_pages_short((OWN_OBJECTS_DEPTH,), str(object_bytes))
    own_huge = not own_huge_short
    own_skipped = "" if odir.direct_ok else "the file system refuses O_DIRECT"
    if not own_skipped:
        own_skipped = _link_objects([odir.path(k) for keys in sessions for k in keys], own_dir)
    if not own_skipped:
        fio_runs[OWN_OBJECTS_JOB], requests[OWN_OBJECTS_JOB] = [], []
    tick = progress("fio + cold loads", cfg.repeats * (len(fio_runs) + len(variants) * len(sessions)
                                                       + (burst is not None) + len(loop_runs)))
    earlier_observer = observe.install(recorder)
    try:
        # Each repeat runs every measurement, fio's and kvtier's, in the order
        # of the one before reversed: on a disk whose speed drifts within a
        # repeat (a throttle's burst credit, writeback), no measurement always
        # runs in the same place.
        steps: list[tuple[str, object]] = [("fio", j) for j in fio_jobs] + [("cold", v) for v in stores]
        if OWN_OBJECTS_JOB in fio_runs:
            steps.insert(len(fio_jobs), ("own", OWN_OBJECTS_JOB))
        if burst is not None:
            steps.insert(len(fio_runs), ("burst", BURST))
        at = len(fio_runs) + (burst is not None)
        steps[at:at] = [(LOOP, (LOOP, w)) for w in loop_runs]
        for rep in range(cfg.repeats):
            for kind, what in (steps if rep % 2 == 0 else steps[::-1]):
                s0 = device.sample()
                if kind == "fio":
                    # fio lays its files out before it reads: sampled around the whole
                    # run, the requests are its reads' (writes are counted apart).
                    depth, block, o_direct, n_streams, file_bytes, on_huge = fio_jobs[what]
                    fio_runs[what].append(fio_seq_read_run(fio_dir, depth, fio_size, block=block, direct=o_direct,
                                                           jobs=n_streams, file_bytes=file_bytes, huge_pages=on_huge))
                    tick(1)
                elif kind == "own":
                    fio_runs[what].append(fio_files_read(own_dir, object_bytes, OWN_OBJECTS_DEPTH, own_huge))
                    tick(1)
                elif kind == "burst":
                    burst_runs.append(burst.run())
                    tick(1)
                elif kind == LOOP:
                    loop_runs[what[1]].append(loop.run(what[1]))
                    tick(1)
                else:
                    stores[what].tier("shared").drop_cache()
                    cold_runs[what].append(load_sessions(stores[what], sessions, into[what], per_load[what], tick,
                                                         "cold load", "see the log", traces.get(what)))
                requests[what].append(device.mean_kib(s0, device.sample()))
        direct = {v: s.tier("shared").dir.direct_ok and fio_mode(v[1]) == "direct" for v, s in stores.items()}
        by_path = {v: {p: int(s.metrics.value("kvtier_read_path_loads_total", tier="shared", path=p))
                       for p in ("direct", "buffered")} for v, s in stores.items()}
        # What drove each variant's reads (native loop, Python AIO driver,
        # pool threads): its figures are that driver's.
        by_driver = {v: {d: int(s.metrics.value("kvtier_load_drivers_total", tier="shared", driver=d))
                         for d in DRIVERS} for v, s in stores.items()}
        # An AIO variant whose tier moved to pool threads during the run (its
        # loads spent most of their time opening files: a network or FUSE
        # mount) is reported as such: its figures mix the two ways.
        aio_stopped = {v for v, s in stores.items() if v[1] in AIO_MODES and not s.tier("shared").reads_with_aio}
        # What kvtier's own metrics counted of each variant's CPU (the tier's
        # threads on load jobs, and the thread asking inside the loads): an
        # operator's view of the same cost, on every load in service.
        counted = {v: s.metrics.value("kvtier_io_cpu_seconds_total", tier="shared", kind="load")
                   + s.metrics.value("kvtier_load_caller_cpu_seconds_total") for v, s in stores.items()}
    finally:
        observe.install(earlier_observer)
        remove_fio_file(fio_dir)
        shutil.rmtree(own_dir, ignore_errors=True)
        if burst is not None:
            burst.close()
        if loop is not None:
            loop.close()
        for st in stores.values():
            st.close()
    # Each job's (O_DIRECT, buffers on huge pages): fio's configured jobs,
    # and its read of kvtier's own objects (always O_DIRECT).
    shapes = {j: (fio_jobs[j][2], fio_jobs[j][5]) for j in fio_jobs} | {OWN_OBJECTS_JOB: (True, own_huge)}
    result["fio"] = {
        j: {**summarize(runs), "read_mode": "direct" if shapes[j][0] else "buffered", "huge_pages": shapes[j][1],
            "request_kib": _median_or_none(requests[j])}
        for j, runs in fio_runs.items()
    }
    result["fio_streams"] = streams
    result["object_bytes"] = object_bytes
    result["fio_best_gbps"] = max(v["median_gbps"] for v in result["fio"].values())
    cold = {
        cold_label(w, m): {
            "window_bytes": w,
            "read_mode": m,
            "runs_gbps": [p.gbps for p in cold_runs[w, m]],
            "median_gbps": median([p.gbps for p in cold_runs[w, m]]),
            "session_load_p50_s": median(per_load[w, m]),
            "o_direct": direct[w, m],
            "loads_by_path": by_path[w, m],  # adaptive reads ("auto"): which path each load took
            "loads_by_driver": by_driver[w, m],
            **({"aio_stopped": True} if (w, m) in aio_stopped else {}),
            "runs_cpu_s_per_gb": [p.cpu_s_per_gb for p in cold_runs[w, m]],
            "cpu_s_per_gb": median([p.cpu_s_per_gb for p in cold_runs[w, m]]),
            # Over all its repeats (the metrics count the whole run).
            "metrics_cpu_s_per_gb": counted[w, m] / (sum(p.nbytes for p in cold_runs[w, m]) / 1e9),
            "metrics_cpu_share": counted[w, m] / sum(p.cpu_s for p in cold_runs[w, m]),
            "request_kib": _median_or_none(requests[w, m]),
            **({"idle_ms": _idle_ms(traces[w, m])} if (w, m) in traces else {}),
        }
        for w, m in variants
    }
    result["cold"] = cold
    best = max(cold, key=lambda w: cold[w]["median_gbps"])
    result["cold_best_window"] = best
    result["cold_load_gbps"] = cold[best]["median_gbps"]
    result["cold_vs_fio"] = result["cold_load_gbps"] / result["fio_best_gbps"]
    if burst_runs:
        result["burst"] = {**summarize(burst_runs), "request_kib": _median_or_none(requests[BURST])}
        result["burst_vs_fio"] = result["burst"]["median_gbps"] / result["fio_best_gbps"]
        result["cold_vs_burst"] = result["cold_load_gbps"] / result["burst"]["median_gbps"]
    else:
        result["burst_skipped"] = burst_skipped
    if loop_runs:
        result["loop_alone"] = {cold_label(w, "direct"): {**summarize(runs), "window_bytes": w,
                                                          "request_kib": _median_or_none(requests[LOOP, w])}
                                for w, runs in loop_runs.items()}
    else:
        result["loop_alone_skipped"] = loop_skipped
    if OBJECT_FILES_JOB in result["fio"]:
        files = result["fio"][OBJECT_FILES_JOB]["median_gbps"]
        result["object_files_vs_fio"] = files / result["fio_best_gbps"]
        result["cold_vs_object_files"] = result["cold_load_gbps"] / files
    if OWN_OBJECTS_JOB in result["fio"]:
        own = result["fio"][OWN_OBJECTS_JOB]["median_gbps"]
        result["own_objects_vs_fio"] = own / result["fio_best_gbps"]
        result["cold_vs_own_objects"] = result["cold_load_gbps"] / own
        if own_huge_short:
            result["own_objects_huge_skipped"] = own_huge_short
    else:
        result["own_objects_skipped"] = own_skipped
    result.update(cpu_comparison(result))
    result.update(store_cost(result))
    result.update(auth_cost(result))

    # 4. memory tier vs memcpy of the same bytes
    lower = _shared_spec(store_dir, capacity, 64 * MiB, cfg.io_threads)
    result.update(memory_bench(cfg, sessions, lower, bufs, progress))
    result["memory_vs_memcpy"] = result["memory_load_gbps"] / result["memcpy_gbps"]
    result.update(cpu_floor(result))
    result["seconds"] = time.perf_counter() - t_start
    return result


def bench_key_file(root: Path) -> str:
    """The benchmark's cluster key file in ``root`` (made on first use)."""
    path = root / "bench.key"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        auth.write_key_file(str(path), [auth.new_key()])
    return str(path)


def _huge_jobs(depths) -> tuple[dict, str]:
    """fio's O_DIRECT jobs at ``depths`` with buffers on huge pages, where
    the host has enough reserved (``huge_pages_short``); else none, and why
    (the report says how to add them)."""
    why = huge_pages_short(depths)
    return ({} if why else {f"qd{d}{HUGE_SUFFIX}": (d, "1M", True, 1, 0, True) for d in depths}), why


def _link_objects(paths: list[Path], folder: Path) -> str:
    """Hard-link ``paths`` into a fresh ``folder`` (the same inodes, so the
    same blocks); "" once done, else why not (a file system without hard
    links)."""
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True)
        for i, p in enumerate(paths):
            os.link(p, folder / f"{i:06d}")
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        return f"could not link the object files for fio: {exc.strerror or exc}"
    return ""


def _idle_ms(trace: ReadTrace) -> dict | None:
    """Medians over a variant's loads of their time with no read in flight,
    by part, and of their wall time (ms)."""
    loads = trace.loads()
    if not loads:
        return None
    return {part: 1e3 * median([getattr(x, f"{part}_s") for x in loads])
            for part in ("load", "start", "between", "tail")}


def _fs_type(path: Path) -> str:
    """File system type and device of the mount holding ``path`` (/proc/mounts)."""
    target = os.path.realpath(path)
    best = ("", "unknown", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}" if best[2] else best[1]
