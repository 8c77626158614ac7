"""``kvtier plan --validate`` on synthetic bench runs with a known truth."""

from __future__ import annotations

from kvtier.cli import main
from kvtier.plan.validate import calibrate_run, find, run_validation
from tests.plan.fakerun import LATENCY, make_run


def test_a_run_that_follows_the_design_validates(tmp_path, capsys):
    d = make_run(tmp_path / "run")
    # Tier latencies are calibrated on another run (another seed), the law on this one.
    other = make_run(tmp_path / "other", seed=1)
    _, io = calibrate_run(other)
    for kind, lat in LATENCY.items():
        assert abs(io[kind].latency_s - lat) < 0.015  # TTFTs carry 3% noise: ~8 ms here
    rows, model = run_validation(*find(d), io=io)
    assert {r.config for r in rows} == {"recompute", "prefix-cache", "kvtier-memory", "kvtier-disk", "kvtier-shared"}
    assert all(r.hits_equal and r.ttft_ok for r in rows)
    mem = next(r for r in rows if r.config == "kvtier-memory" and r.case == "1024")
    assert mem.predicted_hits == {"memory": 3 * 896} and mem.measured_engine == mem.predicted_engine == 0
    assert abs(model.b - 3e-7) < 3e-8  # the fit found the law the run followed
    assert main(["plan", "--validate", str(d), "--calibrate", str(other)]) == 0
    out = capsys.readouterr().out
    # Calibrated on another run: no row of this one is fitted, none says so.
    assert "validation passed" in out and "(calibration)" not in out
    assert main(["plan", "--validate", str(d)]) == 0
    assert "(calibration)" in capsys.readouterr().out  # self-calibrated: recompute and prefix-cache rows are


def test_a_hit_count_off_by_one_token_fails(tmp_path, capsys):
    d = make_run(tmp_path / "run", hit_error=1)
    rows, _ = run_validation(*find(d), io=calibrate_run(d)[1])
    assert not any(r.hits_equal for r in rows if r.config.startswith("kvtier"))
    assert main(["plan", "--validate", str(d)]) == 1
    assert "HITS DIFFER" in capsys.readouterr().out


def test_hits_slower_than_the_law_fail_the_ttft_bound(tmp_path):
    # The hits take 1.3x what the law predicts (the recompute runs that
    # calibrate it do too, so scale only the hit configurations).
    d = make_run(tmp_path / "a")
    slow = make_run(tmp_path / "b", ttft_scale=1.3)
    lines = (d / "requests.jsonl").read_text().splitlines()
    slow_lines = (slow / "requests.jsonl").read_text().splitlines()
    mixed = [s if '"kvtier-' in s else a for a, s in zip(lines, slow_lines)]
    (d / "requests.jsonl").write_text("\n".join(mixed) + "\n")
    rows, _ = run_validation(*find(d), io=calibrate_run(make_run(tmp_path / "c", seed=2))[1])
    bad = {r.config for r in rows if not r.ttft_ok}
    assert bad == {"kvtier-memory", "kvtier-disk", "kvtier-shared"}
