"""``kvtier bench events``: the shared tier's event cost report."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_events_reports_a_pass_its_journal_and_the_events_it_retracts(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "events", "--objects", "300", "--dir",
                           str(tmp_path / "w"), "--json", str(out), "--no-progress"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["stored_events"] == 300
    assert 0 < r["gc_deleted"] == r["removed_events"] and r["journal_bytes"] == 32 * r["gc_deleted"]
    assert r["idle_poll_new"] == 0
    assert not (tmp_path / "w").exists()  # the working directory goes
    assert "BlockRemoved" in proc.stdout


def test_bench_events_refuses_a_store_too_small_to_collect(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "events", "--objects", "3", "--dir",
                           str(tmp_path / "w")], capture_output=True, text=True)
    assert proc.returncode == 2 and "--objects" in proc.stderr and "Traceback" not in proc.stderr
