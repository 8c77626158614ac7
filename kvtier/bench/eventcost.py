"""``kvtier bench events``: what KV events for the shared tier cost, at a
given number of stored objects.

A shared tier of ``--objects`` objects (small ones: the journal and the
events do not depend on an object's size) is filled, every object's chunk
known to a ``BlockEvents`` as an engine that wrote it would know it (vLLM's
own ``Request`` and block hasher; 256-token chunks of 16-token blocks) and published as
stored. Then one collection pass of the tier's default watermarks (above
95 % of capacity, down to 85 %) deletes its share, and a second engine's
view reads the removal journal and retracts what the pass deleted.

Reported: the pass's journal file (bytes), the reader's time for the read
that finds it and for a read that finds nothing new (the steady state of
a poll every ``events.JOURNAL_INTERVAL_S``), the events it makes and their
bytes in vLLM's wire format (msgpack of a ``KVEventBatch``), and those
figures per second for a collection pass every ``--gc-interval`` seconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.progress import Progress, bars

BLOCK = 16  # tokens per vLLM block here (its GPU default)
CHUNK = 256  # kvtier's default chunk: 16 blocks
PER_REQUEST = 100  # chunks per request


def add_parser(bsub) -> None:
    p = bsub.add_parser(
        "events", help="what KV events for the shared tier cost at N stored objects (journal, events, bytes)",
        description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--dir", default=".bench-events", help="working directory: the shared tier's folder is made "
                   "in it and removed at the end (default .bench-events)")
    p.add_argument("--objects", type=int, default=100_000, help="objects stored (default 100000)")
    p.add_argument("--gc-interval", type=float, default=60.0,
                   help="seconds between collection passes, for the per-second figures (default 60: the "
                        "shared tier's gc_interval_s)")
    p.add_argument("--json", help="also write the report to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    if args.objects < 10:
        raise ConfigError("--objects", f"{args.objects} objects leave a collection pass nothing to delete",
                          "give at least 10, e.g. --objects 100000")
    report = run(Path(args.dir), args.objects, args.gc_interval, bars(not args.no_progress))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run(workdir: Path, objects: int, gc_interval: float, progress: Progress | None = None) -> dict:
    import msgspec
    from vllm import SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvtier.codec import encode
    from kvtier.integrations.vllm.events import STORED, BlockEvents, Place
    from kvtier.integrations.vllm.metrics import ConnectorMetrics
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers.shared import SharedConfig, SharedTier
    from prometheus_client import CollectorRegistry

    ns = Namespace(model="bench/events", model_fingerprint="sha256:00", kv_dtype="float16", layout="bench:events",
                   num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=CHUNK)
    root = workdir / "shared"
    shutil.rmtree(workdir, ignore_errors=True)
    root.mkdir(parents=True)
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(BLOCK, fn)
    payload = bytes(1024)  # the journal and the events do not depend on it
    events = BlockEvents(1, {"shared": Place("STORAGE", "REMOTE")}, BLOCK, ConnectorMetrics(CollectorRegistry()),
                         remembered=objects)
    writer = reader = None
    try:
        probe = encode(chunk_keys(ns, list(range(CHUNK)))[0], "float16", (512,), payload)
        size = probe.nbytes
        probe.release()
        config = SharedConfig(path=str(root), capacity=objects * size, gc_interval_s=0.0, io_threads=4)
        writer, reader = SharedTier(config), SharedTier(config)
        t0 = time.perf_counter()
        bar = (progress or bars(False))("objects", objects)
        for r in range(0, objects, PER_REQUEST):
            n = min(PER_REQUEST, objects - r)
            tokens = [(r * CHUNK + i) * 7919 % 150_000 + 3 for i in range(n * CHUNK)]
            tokens[0] = r // PER_REQUEST  # every request its own prefix
            req = Request(f"r{r}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
            keys = chunk_keys(ns, tokens)
            objs = [encode(k, "float16", (512,), payload) for k in keys]
            writer.store(objs)
            for o in objs:
                o.release()
            for i, k in enumerate(keys):
                events.remember(k, req, i * CHUNK)
            events.heard([(STORED, "shared", k.digest) for k in keys])
            bar(n)
        fill_s = time.perf_counter() - t0
        stored = events.take()
        encoder = msgspec.msgpack.Encoder()
        stored_bytes = len(encoder.encode(KVEventBatch(ts=time.time(), events=stored)))
        reader.journal.read_new()  # what was there before the pass: nothing

        t0 = time.perf_counter()
        result = writer.gc()
        gc_s = time.perf_counter() - t0
        journal = sum(f.stat().st_size for f in writer.journal.path.iterdir())
        t0 = time.perf_counter()
        digests = reader.journal.read_new()
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        events.journaled("shared", digests)
        retract_s = time.perf_counter() - t0
        removed = events.take()
        removed_bytes = len(encoder.encode(KVEventBatch(ts=time.time(), events=removed)))
        t0 = time.perf_counter()
        again = reader.journal.read_new()
        idle_s = time.perf_counter() - t0
    finally:
        for t in (writer, reader):
            if t is not None:
                t.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "objects": objects, "object_bytes": size, "fill_s": round(fill_s, 1),
        "stored_events": len(stored), "stored_event_bytes": round(stored_bytes / max(1, len(stored)), 1),
        "gc_deleted": result.deleted, "gc_s": round(gc_s, 3), "journal_bytes": journal,
        "journal_read_s": round(read_s, 4), "retract_s": round(retract_s, 4), "idle_poll_s": round(idle_s, 5),
        "idle_poll_new": len(again),
        "removed_events": len(removed), "removed_batch_bytes": removed_bytes,
        "gc_interval_s": gc_interval,
        "removed_events_per_s": round(len(removed) / gc_interval, 1),
        "removed_bytes_per_s": round(removed_bytes / gc_interval, 1),
        "journal_bytes_per_s_per_engine": round(journal / gc_interval, 1),
    }


def format_report(r: dict) -> str:
    return "\n".join([
        f"KV events for a shared tier of {r['objects']:,} objects ({r['object_bytes']} B each; filled in {r['fill_s']} s)",
        f"  stored: {r['stored_events']:,} BlockStored events, {r['stored_event_bytes']} B each on the wire",
        f"  one collection pass: {r['gc_deleted']:,} deleted in {r['gc_s']} s; journal file {r['journal_bytes']:,} B",
        f"  another engine: reads it in {r['journal_read_s'] * 1e3:.1f} ms, retracts in {r['retract_s'] * 1e3:.1f} ms: "
        f"{r['removed_events']:,} BlockRemoved, {r['removed_batch_bytes']:,} B on the wire",
        f"  a poll that finds nothing new: {r['idle_poll_s'] * 1e3:.2f} ms",
        f"  with a pass every {r['gc_interval_s']:g} s: {r['removed_events_per_s']:,} removed events/s, "
        f"{r['removed_bytes_per_s']:,} B/s of events, {r['journal_bytes_per_s_per_engine']:,} B/s of journal read per engine",
    ])
