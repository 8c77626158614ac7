#!/usr/bin/env python3
"""kvtier's GPU check, with torch alone (no vLLM needed on the GPU host).

    python3 scripts/gpu_check.py                 # on a CUDA (or ROCm) host
    python3 scripts/gpu_check.py --device cpu    # the same checks on CPU tensors

1. Views in every vLLM ``KVCacheLayout`` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
   BHLNC) and kernel-split blocks, built as vLLM 0.30-0.33's
   ``create_kv_cache_views`` builds them (one int8 buffer, strides from the
   layout's axis order), on the device: ``detect`` must name each layout,
   and gather -> scatter through kvtier's ``PageLayout`` must round-trip
   byte-exactly without touching other blocks.
2. Throughput of kvtier's device path (gather of a chunk's blocks into
   host memory, scatter back) against the limit measured in the same run:
   one large pinned ``copy_`` device->host and host->device.

Prints a table and writes ``--json``. Nothing here is vLLM; what it checks
is the byte movement kvtier's worker runs on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtier.integrations.vllm.layout import detect  # noqa: E402

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def views(layout, layers, blocks, heads, block_size, head_size, device, dtype, kernel_block=None):
    """As vLLM's create_kv_cache_views: byte strides over [L, B, H, N, C]."""
    es = torch.tensor([], dtype=dtype).element_size()
    kbs = kernel_block or block_size
    r = block_size // kbs
    shape = [layers, blocks * r, heads, kbs, 2 * head_size * es]
    strides, cur = [0] * 5, 1
    for dim in reversed(["LBHNC".index(c) for c in layout]):
        strides[dim] = cur
        cur *= shape[dim]
    buf = torch.randint(-128, 128, (cur,), dtype=torch.int8, device=device)
    v5 = torch.as_strided(buf, shape, strides)
    return buf, [v5[i].view(dtype) for i in range(layers)]


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def round_trip(layout, heads, device, split=None):
    bs = 32 if split else 16
    buf, vs = views(layout, 4, 12, heads, bs, 64, device, torch.bfloat16, kernel_block=16 if split else None)
    pl = detect(vs, 12, expected=layout)
    r = pl.split
    src, dst = [3, 7, 1], [2, 9, 5]
    host = torch.empty(pl.chunk_shape(3), dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    want = [[v[b * r:(b + 1) * r].clone() for v in vs] for b in src]
    pl.gather(src, host)
    if device.type == "cuda":
        torch.cuda.synchronize()
    before = buf.clone()
    pl.scatter(dst, host)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ok = all(torch.equal(as_bytes(v[b * r:(b + 1) * r]), as_bytes(w[i]))
             for b, w in zip(dst, want) for i, v in enumerate(vs))
    # Bytes outside the destination blocks are unchanged.
    mask = torch.zeros_like(buf, dtype=torch.bool)
    for v in vs:
        for b in dst:
            page = v[b * r:(b + 1) * r]
            idx = torch.zeros(page.shape, dtype=torch.long, device=device)
            for d, (n, s) in enumerate(zip(page.shape, page.stride())):
                shape = [1] * page.dim()
                shape[d] = n
                idx = idx + (torch.arange(n, device=device) * s).view(shape)
            base = page.storage_offset() * page.element_size()
            for k in range(page.element_size()):
                mask[(base + idx * page.element_size() + k).flatten()] = True
    untouched = torch.equal(buf[~mask], before[~mask])
    return {"layout": pl.name, "heads": heads, "page": pl.describe(), "exact": bool(ok), "untouched": bool(untouched)}


def device_path(device, layout="LBNHC"):
    """kvtier's device data path (transfer.py: pinned staging reused, copy
    stream, events) round-trips a chunk: save enqueued behind the engine's
    stream, bytes read once its event completed, loaded back elsewhere."""
    from kvtier.integrations.vllm.transfer import DevicePath

    buf, vs = views(layout, 4, 12, 8, 16, 64, device, torch.bfloat16)
    pl = detect(vs, 12, expected=layout)
    dp = DevicePath(pl)
    want = [v[3].clone() for v in vs]
    p = dp.save([3, 4])
    payload = bytes(dp.saved_bytes(p))
    dp.release(p)
    q = dp.load([8, 9], memoryview(payload), pl.chunk_shape(2))
    torch.cuda.current_stream(device).synchronize()
    ok = q.finished() and all(torch.equal(as_bytes(v[8]), as_bytes(w)) for v, w in zip(vs, want))
    dp.release(q)
    return {"layout": layout, "exact": bool(ok), "staging_buffers": dp.staging.allocated}


def throughput(device, repeats, layout="LBNHC"):
    """GiB/s of kvtier's gather/scatter for a 256-token chunk of a
    Qwen2.5-7B-shaped model (28 layers, 4 KV heads, head 128, bf16:
    14 MiB), against one large pinned copy each way."""
    layers, heads, head, bs, blocks = 28, 4, 128, 16, 2048
    _, vs = views(layout, layers, blocks, heads, bs, head, device, torch.bfloat16)
    pl = detect(vs, blocks, expected=layout)
    n = 256 // bs
    ids = list(range(100, 100 + 2 * n, 2))  # scattered blocks, as an engine holds them
    pin = device.type == "cuda"
    host = torch.empty(pl.chunk_shape(n), dtype=torch.bfloat16, pin_memory=pin)
    nbytes = host.numel() * host.element_size()

    def timed(fn):
        fn()
        if pin:
            torch.cuda.synchronize()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            if pin:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        out.sort()
        return out[len(out) // 2]

    gather = timed(lambda: pl.gather(ids, host))
    scatter = timed(lambda: pl.scatter(ids, host))
    big = 1 << 30
    dev = torch.empty(big, dtype=torch.uint8, device=device)
    hbuf = torch.empty(big, dtype=torch.uint8, pin_memory=pin)
    d2h = timed(lambda: hbuf.copy_(dev, non_blocking=pin))
    h2d = timed(lambda: dev.copy_(hbuf, non_blocking=pin))
    gib = 1 << 30
    return {
        "chunk_bytes": nbytes,
        "gather_gib_s": nbytes / gather / gib, "scatter_gib_s": nbytes / scatter / gib,
        "d2h_limit_gib_s": big / d2h / gib, "h2d_limit_gib_s": big / h2d / gib,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default="gpu_check.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    rows = [round_trip(lay, h, device) for lay in LAYOUTS for h in (1, 8)]
    rows += [round_trip(lay, 8, device, split=True) for lay in ("LBHNC", "LBNHC")]
    print("| layout | heads | page | byte-exact | other blocks untouched |")
    print("|---|---:|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['heads']} | {r['page']} | {r['exact']} | {r['untouched']} |")
    dpath = device_path(device) if device.type == "cuda" else None
    if dpath is not None:
        print(f"\ndevice path (pinned staging, copy stream, events): byte-exact {dpath['exact']}, "
              f"{dpath['staging_buffers']} staging buffer(s) for a save and a load")
        rows.append({**dpath, "heads": 8, "page": "device path", "untouched": True})
    tp = throughput(device, args.repeats)
    print(f"\nchunk of {tp['chunk_bytes'] / 2**20:.1f} MiB, median of {args.repeats}:")
    print(f"  gather (device -> host): {tp['gather_gib_s']:.2f} GiB/s; limit (1 GiB pinned copy) "
          f"{tp['d2h_limit_gib_s']:.2f} GiB/s: {tp['gather_gib_s'] / tp['d2h_limit_gib_s']:.2f}x")
    print(f"  scatter (host -> device): {tp['scatter_gib_s']:.2f} GiB/s; limit {tp['h2d_limit_gib_s']:.2f} GiB/s: "
          f"{tp['scatter_gib_s'] / tp['h2d_limit_gib_s']:.2f}x")
    Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "layouts": rows,
                                           "throughput": tp}, indent=2))
    ok = all(r["exact"] and r["untouched"] for r in rows)
    print("\nall layouts round-trip exactly" if ok else "\nFAILED: a layout did not round-trip")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
