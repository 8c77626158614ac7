"""The ratios and acceptance bars of `kvtier bench resume`, from made-up figures (no engine)."""

import pytest

from kvtier.bench.resume_report import _checks, _ratios


def _w1(example_ttft: float) -> dict:
    base = {"kvtier_read_bytes": 4e8, "requests": 4, "throughput_rps": 1.0}
    return {
        "recompute": {**base, "ttft_p50_s": 10.0},
        "kvtier-memory": {**base, "ttft_p50_s": 0.5},
        "kvtier-shared": {**base, "ttft_p50_s": 0.6},
        "example": {**base, "ttft_p50_s": example_ttft},
    }


def test_w1_ratios_and_bars():
    by = _w1(example_ttft=1.0)
    r = _ratios("w1", by, {"best_gbps": 1.0})
    assert r["speedup_shared_vs_recompute"] == 10.0 / 0.6
    assert abs(r["floor_s"] - 0.6) < 1e-9  # memory 0.5 s + 100 MB per resume at 1 GB/s
    # The bar's load is TTFT minus the floor: kvtier-shared sits on it (0 s),
    # example 0.4 s above it. Reads included, it is 0.1 s against 0.5 s.
    assert r["load_measure"] == "over_floor_s"
    assert abs(by["example"]["over_floor_s"] - 0.4) < 1e-9
    assert r["load_vs_example"] == 0.0
    assert abs(r["load_incl_reads_vs_example"] - 0.1 / 0.5) < 1e-9
    c = _checks(r)
    assert c["speedup_shared_vs_recompute"]["met"] is False  # 16.7x < 30x
    assert c["load_vs_example"]["met"] is True and c["shared_over_floor"]["met"] is True
    assert c["lower_ttft_than_example"]["met"] is True
    # The speedup bar is stated from 8k tokens on; shorter cases show the speedup only.
    assert "speedup_shared_vs_recompute" not in _ratios("w1", _w1(1.0), {"best_gbps": 1.0}, "2048")
    assert "speedup_shared_vs_recompute" in _ratios("w1", _w1(1.0), {"best_gbps": 1.0}, "8192")


def test_load_over_the_floor_divides_what_is_left_above_it():
    by = _w1(example_ttft=1.0)
    by["kvtier-shared"]["ttft_p50_s"] = 0.7  # 0.1 s above the 0.6 s floor; example 0.4 s
    r = _ratios("w1", by, {"best_gbps": 1.0})
    assert abs(r["load_vs_example"] - 0.1 / 0.4) < 1e-9
    assert _checks(r)["load_vs_example"]["met"] is True
    by["kvtier-shared"]["ttft_p50_s"] = 0.85  # 0.25 s above it: more than half of example's
    assert _checks(_ratios("w1", by, {"best_gbps": 1.0}))["load_vs_example"]["met"] is False


def test_without_fio_the_load_is_measured_over_a_memory_hit():
    by = _w1(example_ttft=1.0)
    r = _ratios("w1", by, None)
    assert r["load_measure"] == "load_s" and "floor_s" not in r
    assert abs(r["load_vs_example"] - 0.1 / 0.5) < 1e-9


def test_example_load_in_the_noise_is_reported_not_divided():
    by = _w1(example_ttft=0.59)  # under the floor (0.6 s): no load left to compare with
    r = _ratios("w1", by, {"best_gbps": 1.0})
    assert r["load_vs_example"] is None
    c = _checks(r)["load_vs_example"]
    assert c["met"] is None and "not measurable" in c["why"]
    assert _checks(r)["lower_ttft_than_example"]["met"] is False


def test_w0_overhead_is_the_median_of_paired_rounds():
    by = {"prefix-cache": {"ttft_p50_s": 1.0, "throughput_rps_rounds": [1.0, 2.0, 4.0]},
          "kvtier-shared": {"ttft_p50_s": 1.0, "throughput_rps_rounds": [0.99, 1.9, 4.4]}}
    r = _ratios("w0", by, None)
    assert r["w0_round_ratios"] == [0.99, 0.95, 1.1]
    assert abs(r["w0_overhead"] - 0.01) < 1e-9
    assert _checks(r)["w0_overhead"]["met"] is True


def test_a_difference_within_the_runs_spread_is_a_tie():
    by = _w1(example_ttft=0.59)
    by["kvtier-shared"]["ttft_s"] = [0.55, 0.6, 0.65]  # spread 0.05 s: 10 ms above example is a tie
    by["example"]["ttft_s"] = [0.58, 0.59, 0.60]
    r = _ratios("w1", by, {"best_gbps": 1.0})
    assert r["ttft_vs_example"]["kvtier-shared"]["verdict"] == "tie"
    assert r["ttft_vs_example"]["kvtier-memory"]["verdict"] == "below"
    c = _checks(r)["lower_ttft_than_example"]
    assert c["met"] is True and c["ties"] == ["kvtier-shared"]
    assert c["above"] == {}
    by["kvtier-shared"]["ttft_p50_s"] = 0.7  # 110 ms above: beyond the spread
    c = _checks(_ratios("w1", by, {"best_gbps": 1.0}))["lower_ttft_than_example"]
    assert c["met"] is False and list(c["above"]) == ["kvtier-shared"]  # named, with its margin
    assert c["above"]["kvtier-shared"]["diff_s"] == pytest.approx(0.11)
    assert c["above"]["kvtier-shared"]["noise_s"] == pytest.approx(0.05)


def test_multiprocess_runs_are_compared_with_their_single_process_runs():
    by = _w1(example_ttft=1.0)
    by["kvtier-memory+mp"] = {**by["kvtier-memory"], "ttft_p50_s": 0.51}
    by["kvtier-shared+mp"] = {**by["kvtier-shared"], "ttft_p50_s": 0.66}
    r = _ratios("w1", by, {"best_gbps": 1.0})
    assert abs(r["multiprocess_each"]["kvtier-memory+mp"] - 0.51 / 0.5) < 1e-9
    assert abs(r["multiprocess_vs_single"] - 0.66 / 0.6) < 1e-9  # the worst of them
    c = _checks(r)["multiprocess_vs_single"]
    assert c["kind"] == "at most" and c["bar"] == 1.05 and c["met"] is False


def test_rounds_run_the_configurations_abba_except_w0():
    from kvtier.bench.resume import round_order
    names = ("kvtier-memory", "kvtier-memory+mp")
    w1 = [round_order(names, r, "w1") for r in range(4)]
    assert w1 == [names, names[::-1], names, names[::-1]]
    # each configuration goes first as often as the other over an even number of rounds
    assert sum(o[0] == "kvtier-memory" for o in w1) == 2
    assert all(round_order(names, r, "w0") == names for r in range(3))


def test_read_path_configurations_read_the_shared_tier_their_way(tmp_path):
    """kvtier-shared-buffered / -direct / -aio run the shared tier buffered,
    with O_DIRECT from a thread per read, and through native AIO (the
    default, as kvtier-shared),
    cold like kvtier-shared, so that one run compares the read paths."""
    from kvtier.bench import resume, resume_configs, workloads
    from kvtier.config import parse_tier

    cfg = resume.ResumeConfig(workdir=tmp_path, configs=("kvtier-shared", "kvtier-shared-buffered", "kvtier-shared-direct",
                                                         "kvtier-shared-aio"))
    work = workloads.w1(2, 512, 100)
    tiers = {}
    for name in cfg.configs + ("kvtier-shared-aio+mp",):
        assert resume_configs.valid_config(name)
        spec = resume_configs.engine_spec(cfg, name, "512", work, tmp_path, 0, None)
        assert spec["cold"] == {"drop_page_cache": True}, name
        (tier,) = spec["kvtier"]["tiers"]
        parsed = parse_tier(tier, "tiers[0]").config  # what the engine's connector will build
        # Unset options take the file tiers' defaults: O_DIRECT through native AIO, not adaptive.
        opts = ("o_direct", "aio", "adaptive_reads")
        defaults = (True, True, False)
        assert tuple(getattr(parsed, k) for k in opts) == tuple(tier.get(k, d) for k, d in zip(opts, defaults))
        tiers[name] = {"kind": tier["kind"], **{k: tier.get(k, d) for k, d in zip(opts, defaults)}}
    assert tiers["kvtier-shared"] == {"kind": "shared", "o_direct": True, "aio": True, "adaptive_reads": False}
    assert tiers["kvtier-shared-buffered"]["o_direct"] is False
    assert tiers["kvtier-shared-direct"] == {"kind": "shared", "o_direct": True, "aio": False, "adaptive_reads": False}
    assert (tiers["kvtier-shared-aio"] == tiers["kvtier-shared-aio+mp"]
            == {"kind": "shared", "o_direct": True, "aio": True, "adaptive_reads": False})
    assert not resume_configs.valid_config("kvtier-shared-turbo")


def test_the_4k_configuration_reads_the_default_path_into_buffers_on_small_pages(tmp_path):
    """kvtier-shared-4k is kvtier-shared with the store's huge_pages off,
    so that one run measures what huge-page read buffers change."""
    from kvtier.bench import resume, resume_configs, workloads
    from kvtier.config import load_config
    from kvtier.integrations.vllm.settings import CONNECTOR_KEYS

    cfg = resume.ResumeConfig(workdir=tmp_path, configs=("kvtier-shared", "kvtier-shared-4k"))
    work = workloads.w1(2, 512, 100)
    specs = {n: resume_configs.engine_spec(cfg, n, "512", work, tmp_path, 0, None) for n in cfg.configs}
    # What the connector builds: its own keys apart, the rest a store config.
    built = {n: load_config(None, {k: v for k, v in s["kvtier"].items() if k not in CONNECTOR_KEYS}, environ={})
             for n, s in specs.items()}
    assert built["kvtier-shared"].huge_pages is True
    assert built["kvtier-shared-4k"].huge_pages is False
    assert specs["kvtier-shared-4k"]["cold"] == specs["kvtier-shared"]["cold"] == {"drop_page_cache": True}
    assert [{k: v for k, v in t.items() if k != "path"} for t in specs["kvtier-shared-4k"]["kvtier"]["tiers"]] == \
        [{k: v for k, v in t.items() if k != "path"} for t in specs["kvtier-shared"]["kvtier"]["tiers"]]


def test_the_w32_configuration_is_the_shared_tier_with_a_smaller_read_window(tmp_path):
    from kvtier.bench import resume, resume_configs, workloads
    from kvtier.config import load_config
    from kvtier.integrations.vllm.settings import CONNECTOR_KEYS

    cfg = resume.ResumeConfig(workdir=tmp_path, configs=("kvtier-shared", "kvtier-shared-w32"))
    work = workloads.w1(2, 512, 100)
    specs = {n: resume_configs.engine_spec(cfg, n, "512", work, tmp_path, 0, None) for n in cfg.configs}
    tiers = {n: load_config(None, {k: v for k, v in s["kvtier"].items() if k not in CONNECTOR_KEYS},
                            environ={}).tiers[0].config for n, s in specs.items()}
    assert tiers["kvtier-shared"].read_window_bytes == 128 << 20
    assert tiers["kvtier-shared-w32"].read_window_bytes == 32 << 20
    assert specs["kvtier-shared-w32"]["cold"] == {"drop_page_cache": True}


def test_warmup_runs_the_first_configuration_once_unmeasured_before_the_rounds(tmp_path, monkeypatch):
    from kvtier.bench import resume

    calls = []

    def engine_run(cfg, name, label, workload, model_dir, rnd, device=None):
        calls.append((name, rnd))
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(resume, "_run_config", engine_run)
    monkeypatch.setattr(resume, "unavailable_peers", dict)
    cfg = resume.ResumeConfig(workdir=tmp_path, contexts=(512,), sessions=2, configs=("kvtier-memory", "kvtier-shared"),
                              rounds=2, warmup=True, fio=False)
    with pytest.raises(RuntimeError, match="every configuration failed"):
        resume.run(cfg, log=lambda *a: None)
    assert calls == [("kvtier-memory", -1), ("kvtier-memory", 0), ("kvtier-shared", 0),
                     ("kvtier-shared", 1), ("kvtier-memory", 1)]
