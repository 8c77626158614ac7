"""A process that uses one shared directory; started by test_shared.py.

    shared_worker.py mix DIR SECONDS SEED     store, fetch and collect at random,
                                              then print a JSON summary
    shared_worker.py writer DIR SEED          publish large objects in a loop
                                              until killed (prints "ready" first)

Payloads are a pure function of the key, so a reader knows what it must see.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

from kvtier.codec import encode
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Metrics
from kvtier.tiers.shared import SharedConfig, SharedTier

# 16 tokens x 16 KiB of KV: 256 KiB payloads, large enough to take many write calls' worth of time.
MIX_NS = Namespace("mp/model", "sha256:mp", "float16", "test:LKHTD", num_layers=8, num_kv_heads=8, head_dim=64,
                   chunk_tokens=16)
MIX_CHUNKS = 48
MIX_OBJ = 4096 + 16 * 16384
# 4 MiB payloads for the writer that gets killed: writes take milliseconds.
BIG_NS = Namespace("mp/big", "sha256:mp", "float16", "test:LKHTD", num_layers=16, num_kv_heads=8, head_dim=128,
                   chunk_tokens=64)
BIG_PER_WRITER = 4


def payload(key, nbytes: int) -> bytes:
    seed = hashlib.sha256(b"mp-payload" + key.digest).digest()
    return (seed * (nbytes // 32 + 1))[:nbytes]


def mix_keys():
    return chunk_keys(MIX_NS, [(i * 7919) % 50_000 for i in range(MIX_CHUNKS * MIX_NS.chunk_tokens)])


def big_keys(seed: int):
    tokens = [(seed * 1_000_003 + i) % 50_000 for i in range(BIG_PER_WRITER * BIG_NS.chunk_tokens)]
    return chunk_keys(BIG_NS, tokens)


def _shape(ns: Namespace, num_tokens: int):
    return (ns.num_layers, 2, ns.num_kv_heads, num_tokens, ns.head_dim)


def _obj(ns: Namespace, key):
    shape = _shape(ns, key.num_tokens)
    n = 2 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
    return encode(key, "float16", shape, payload(key, n))


def mix(path: str, seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    keys = mix_keys()
    objs = {}
    metrics = Metrics()
    cfg = SharedConfig(path=path, capacity=24 * MIX_OBJ, io_threads=4, gc_interval_s=0.2, touch_interval_s=0.05)
    tier = SharedTier(cfg, metrics)
    out = {"reads": 0, "hits": 0, "writes": 0, "mismatches": 0, "errors": [], "gc_runs": 0}
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            i = rng.randrange(MIX_CHUNKS - 3)
            op = rng.random()
            if op < 0.45:
                if i not in objs:
                    objs[i] = _obj(MIX_NS, keys[i])
                tier.store([objs[i]])
                out["writes"] += 1
            elif op < 0.97:
                run = keys[i : i + 4]
                out["reads"] += 1
                for n, obj in enumerate(tier.fetch(run)):
                    out["hits"] += 1
                    ok = obj.header.matches(run[n]) and bytes(obj.payload) == payload(run[n], obj.header.payload_len)
                    out["mismatches"] += not ok
            else:
                out["gc_runs"] += tier.gc().ran
    except Exception as exc:  # reported to the test, which fails on it
        out["errors"].append(repr(exc))
    finally:
        tier.close()
    out["integrity_failures"] = metrics.value("kvtier_integrity_failures_total", tier="shared")
    out["io_errors"] = sum(
        metrics.value("kvtier_errors_total", tier="shared", op=op) for op in ("lookup", "load", "store")
    )
    print(json.dumps(out))
    return 0


def writer(path: str, seed: int) -> int:
    keys = big_keys(seed)
    objs = [_obj(BIG_NS, k) for k in keys]
    tier = SharedTier(SharedConfig(path=path, capacity=1 << 34, io_threads=2, gc_interval_s=0.0))
    print("ready", flush=True)
    while True:
        for k, o in zip(keys, objs):
            tier.delete([k])
            tier.store([o])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "mix":
        sys.exit(mix(sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
    sys.exit(writer(sys.argv[2], int(sys.argv[3])))
