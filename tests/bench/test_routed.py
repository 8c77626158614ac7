"""``kvtier bench resume --workload w3 --routing random,sticky,events``
without engines: how the in-process engines' settings become ``kvtier
serve`` arguments and a config file, what the report counts, and the
command lines it refuses. The run itself (servers started, each routing
measured) is test_resume_smoke.py's."""

from __future__ import annotations

import pytest

from kvtier.bench import routed, workloads
from kvtier.bench.resume_configs import ResumeConfig, engine_args, engine_spec


def test_engine_settings_become_vllm_serve_flags():
    flags = routed.vllm_flags({"enable_prefix_caching": True, "enforce_eager": True, "max_model_len": 768,
                               "num_gpu_blocks_override": 7, "dtype": "bfloat16", "trust_remote_code": False,
                               "kv_transfer_config": {"a": 1}})
    assert flags == ["--enable-prefix-caching", "--enforce-eager", "--max-model-len", "768",
                     "--num-gpu-blocks-override", "7", "--dtype", "bfloat16", "--no-trust-remote-code",
                     "--kv-transfer-config", '{"a": 1}']


def test_the_shared_configuration_becomes_a_config_file_kvtier_serve_accepts(tmp_path):
    import json

    from kvtier.config import load_config
    from kvtier.integrations.vllm.settings import connector_section, parse_connector_keys

    cfg = ResumeConfig(workdir=tmp_path, workload="w3", instances=2, load_decision="always")
    wl = workloads.w3(2, 512, 1000, 2)
    spec = engine_spec(cfg, "kvtier-shared", "512", wl, tmp_path / "model", 1, None, str(tmp_path / "node"))
    data = routed.kvtier_file(spec["kvtier"])
    assert data["vllm"] == {"load_decision": "always"} and "load_decision" not in data
    path = tmp_path / "kvtier.json"
    path.write_text(json.dumps(data))
    (tmp_path / "stores" / "w3-kvtier-shared-512").mkdir(parents=True)
    store = load_config(str(path), environ={})
    assert [t.kind for t in store.tiers] == ["shared"]
    assert str(store.tiers[0].config.path) == str(tmp_path / "stores" / "w3-kvtier-shared-512")
    assert parse_connector_keys(connector_section(str(path), {}), ["shared"]).decision.mode == "always"
    # The engines are set as the in-process W3 engines are: one request's blocks each.
    assert spec["engine"] == engine_args(cfg, wl, "kvtier-shared")


def test_resumes_on_the_warm_instance_are_counted():
    recs = [{"phase": "warm", "session": 0, "endpoint": 1}, {"phase": "warm", "session": 1, "endpoint": 0},
            {"phase": "resume", "session": 0, "endpoint": 1}, {"phase": "resume", "session": 1, "endpoint": 1},
            {"phase": "resume-2", "session": 1, "endpoint": 0}]
    assert routed.resumes_on_warm_instance(recs) == (2, 3)


def test_every_server_gets_an_equal_share_of_the_cpus():
    # Where the CPUs divide evenly, each server is bound to its own.
    assert routed.cpu_plan([0, 1], 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    assert routed.cpu_plan([0, 1, 2, 3], 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
                                                {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    # Three on two: none bound (one bound alone would run twice as fast), one thread each.
    assert routed.cpu_plan([0, 1], 3) == [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}] * 3
    assert routed.cpu_plan([0, 1, 2, 3, 4, 5, 6], 3)[2] == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                            "OMP_NUM_THREADS": "2"}


def test_rounds_pool_their_requests_and_keep_each_rounds_p50(tmp_path):
    def run(routing, rnd, ttfts):
        recs = [{"phase": "warm", "session": i, "endpoint": i % 2, "ttft_s": 9.0, "prompt_tokens": 512,
                 "cached_tokens": 0, "queue_s": 0.0} for i in range(len(ttfts))]
        recs += [{"phase": "resume", "session": i, "endpoint": 0, "ttft_s": t, "prompt_tokens": 512,
                  "cached_tokens": 384, "queue_s": 0.0} for i, t in enumerate(ttfts)]
        return {"config": routing, "case": "512", "round": rnd, "records": recs, "measured": ["resume"],
                "span_s": {"resume": 2.0}, "kvtier_metrics": {}, "vllm_metrics": {}}

    cfg = ResumeConfig(workdir=tmp_path, workload="w3", instances=2, rounds=2)
    runs = [run("events", 0, [1.0, 2.0, 3.0]), run("events", 1, [5.0, 6.0, 7.0])]
    s = routed.summarise(cfg, "kvtier-shared", ("events",), runs, [], [], {}, {}, {})
    v = s["results"]["512"]["events"]
    assert v["requests"] == 6 and v["ttft_p50_s_rounds"] == [2.0, 6.0]
    assert (v["resumes_on_warm_instance"], v["resumes"]) == (4, 6)
    assert "2 rounds (ABBA)" in s["description"] and "2.000s 6.000s" in routed.format_table(s)


@pytest.mark.parametrize("args, key", [
    (["--workload", "w1", "--routing", "random,sticky"], "--routing"),
    (["--workload", "w3", "--routing", "workload,events"], "--routing"),
    (["--workload", "w3", "--routing", "random,nearest"], "--routing"),
    (["--workload", "w3", "--routing", "events,events"], "--routing"),
    (["--workload", "w3", "--routing", "events", "--events", "tcp://a:5557"], "--events"),
    (["--workload", "w3", "--routing", "events,sticky", "--configs", "kvtier-shared,kvtier-local-disk"], "--configs"),
    (["--workload", "w3", "--routing", "random,sticky", "--endpoint", "http://a:8000"], "--routing"),
    (["--workload", "w3", "--routing", "sticky", "--warmup"], "--warmup"),
])
def test_the_cli_refuses_routings_it_cannot_run(args, key, capsys, tmp_path):
    from kvtier import cli

    assert cli.main(["bench", "resume", "--dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "Fix:" in err and "Traceback" not in err
