"""Environment for engine subprocesses that kvtier's benchmarks start.

On CPU hosts vLLM prefills faster with tcmalloc and Intel's OpenMP
preloaded (vLLM's CPU installation guide recommends both); both are used
when present, and the choice is recorded so reports say what ran.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def engine_env(base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    preload = [p for p in _TCMALLOC if Path(p).exists()][:1]
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    return env
