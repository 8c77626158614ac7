"""The endpoint client against small fake OpenAI-compatible servers (no vLLM):
streaming, token-id prompts, routing, per-server metric deltas, errors.
The real thing (two vllm serve processes) is tests/integrations/vllm/test_serve.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.bench import endpoint
from kvtier.bench.workloads import Phase, Request, Workload, w3

BLOCK = 128


class FakeServer:
    """Streams ``max_tokens`` tokens (a function of the prompt), one chunk
    each, the first after ``first_delay_s``; counts prompts it has seen
    before (whole blocks) as cached; exposes vLLM/kvtier-named counters. The
    request counter is bumped ``stats_lag_s`` after the stream ends, as vLLM
    records stats after streaming."""

    def __init__(self, name: str, first_delay_s: float = 0.0, stats_lag_s: float = 0.0, fail: bool = False):
        self.name = name
        self.first_delay_s = first_delay_s
        self.stats_lag_s = stats_lag_s
        self.fail = fail
        self.seen: set[tuple[int, ...]] = set()
        self.bodies: list[dict] = []
        self.counters: dict[str, float] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": f"model-{server.name}"}]}).encode())
                elif self.path == "/metrics":
                    self._send(200, server.exposition().encode(), "text/plain")
                else:
                    self._send(404, b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                if server.fail:
                    self._send(500, b'{"error": "boom"}')
                    return
                prompt = body["prompt"]
                # Text prompts: this fake's "tokenizer" reads space-separated ids.
                prompt = tuple(int(w) for w in prompt.split()) if isinstance(prompt, str) else tuple(prompt)
                cached = server.cached(prompt)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                time.sleep(server.first_delay_s)
                for i in range(body["max_tokens"]):
                    tok = (sum(prompt) + i) % 1000
                    chunk = {"choices": [{"index": 0, "text": "", "token_ids": [tok]}]}
                    if i == 0:
                        chunk["choices"][0]["prompt_token_ids"] = list(prompt)
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
                threading.Timer(server.stats_lag_s, server.count_request, (len(prompt),)).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def cached(self, prompt: tuple[int, ...]) -> int:
        with self.lock:
            n = (len(prompt) - 1) // BLOCK * BLOCK
            hit = n if prompt[:n] in self.seen else 0
            self.seen.add(prompt[:n])
            if hit:
                self._inc('kvtier_vllm_external_hit_tokens_total{tier="shared"}', hit)
                self._inc('vllm:external_prefix_cache_hits_total{engine="0",model_name="m"}', hit)
            return hit

    def count_request(self, prompt_tokens: int) -> None:
        with self.lock:
            self._inc('vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}', 1)
            self._inc('vllm:prompt_tokens_total{engine="0",model_name="m"}', prompt_tokens)

    def _inc(self, key: str, v: float) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + v

    def exposition(self) -> str:
        with self.lock:
            lines = []
            for name in sorted({k.split("{")[0] for k in self.counters}):
                lines.append(f"# TYPE {name} counter")
                lines += [f"{k} {v}" for k, v in self.counters.items() if k.split("{")[0] == name]
            lines.append("# TYPE kvtier_used_bytes gauge")
            lines.append('kvtier_used_bytes{pid="1",tier="shared"} 123.0')
            return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[FakeServer] = []

    def make(n: int, **kw) -> list[FakeServer]:
        made.extend(FakeServer(f"s{i}", **kw) for i in range(n))
        return made[-n:]

    yield make
    for s in made:
        s.close()


def test_w3_routes_by_instance_and_attributes_hits_per_server(servers):
    a, b = servers(2, stats_lag_s=0.3)
    wl = w3(sessions=6, context=300, vocab=500, instances=2, seed=3)
    out = endpoint.run_workload(wl, [a.url, b.url], routing="workload")

    assert out["models"] == ["model-s0", "model-s1"]
    assert [p["name"] for p in out["phases"]] == ["warm", "resume"]
    recs = {r["id"]: r for r in out["records"]}
    assert len(recs) == 12
    for r in out["records"]:
        assert r["endpoint"] == r["instance"] and r["server"] == [a.url, b.url][r["instance"]]
        assert r["ttft_s"] > 0 and r["output_tokens"] == 1
    # What each fake got: token ids as the prompt, greedy, streamed with usage.
    body = a.bodies[0]
    assert isinstance(body["prompt"], list) and all(isinstance(t, int) for t in body["prompt"])
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    assert body["return_token_ids"] and body["model"] == "model-s0"

    # A resume on the server that warmed it hits there; elsewhere it misses.
    resume = out["phases"][1]
    expect_hits = [0, 0]
    for i in range(6):
        w, r = recs[f"s{i}-warm"], recs[f"s{i}-resume"]
        same = w["endpoint"] == r["endpoint"]
        assert r["cached_tokens"] == (256 if same else 0)
        expect_hits[r["endpoint"]] += 256 if same else 0
    assert 0 < sum(expect_hits) < 6 * 256, "seed 3 must mix same- and other-server resumes"
    for k, srv in enumerate(resume["servers"]):
        sent = sum(1 for r in out["records"] if r["phase"] == "resume" and r["endpoint"] == k)
        assert srv["requests"] == sent
        # The request counter lags the stream by 0.3 s: the scrape waited for it.
        assert srv["summary"]["requests"] == sent
        assert srv["summary"]["prompt_tokens"] == 300 * sent
        assert srv["summary"]["kvtier_hit_tokens_by_tier"].get("shared", 0) == expect_hits[k]
        assert srv["summary"]["external_prefix_cache_hits"] == expect_hits[k]
        assert not any(key.startswith("kvtier_used_bytes") for key in srv["metrics"]), "gauges are not deltas"
    assert out["phases"][0]["servers"][0]["summary"]["kvtier_hit_tokens_by_tier"] == {}
    assert any("cold" in n for n in out["notes"])


def test_before_cold_runs_before_each_cold_phase_and_says_what_it_did(servers):
    a, b = servers(2)
    wl = w3(sessions=2, context=200, vocab=500, instances=2, seed=1, resumes=2)
    seen = []

    def cold() -> str:
        seen.append(sum(len(s.bodies) for s in (a, b)))  # the requests served before it ran
        return "dropped"

    out = endpoint.run_workload(wl, [a.url, b.url], routing="random", before_cold=cold, settle_s=2)
    assert [p["name"] for p in out["phases"]] == ["warm", "resume", "resume-2"]
    assert seen == [2, 4]
    assert out["notes"] == ["dropped"]


def test_sticky_keeps_sessions_and_random_spreads_them(servers):
    a, b, c = servers(3)
    wl = w3(sessions=12, context=200, vocab=500, instances=3, seed=1)
    urls = [a.url, b.url, c.url]
    sticky = endpoint.run_workload(wl, urls, routing="sticky", seed=5)
    where = {}
    for r in sticky["records"]:
        assert where.setdefault(r["session"], r["endpoint"]) == r["endpoint"]
        if r["phase"] == "resume":
            assert r["cached_tokens"] == 128  # (200 - 1) // 128 * 128, on the same server
    assert len(set(where.values())) > 1

    rnd = endpoint.run_workload(wl, urls, routing="random", seed=5)
    moved = sum(1 for s in range(12)
                if {r["endpoint"] for r in rnd["records"] if r["session"] == s}.__len__() > 1)
    assert moved > 0
    assert {r["endpoint"] for r in rnd["records"]} == {0, 1, 2}


def test_ttft_is_time_to_first_streamed_token(servers):
    (a,) = servers(1, first_delay_s=0.3)
    reqs = (Request("r0", 0, 0, tuple(range(3, 50)), 3),)
    wl = Workload("T", "one request", (Phase("p", reqs),))
    out = endpoint.run_workload(wl, [a.url], models=["m"])
    (r,) = out["records"]
    assert 0.3 <= r["ttft_s"] < 2.0
    assert r["output"] == [(sum(range(3, 50)) + i) % 1000 for i in range(3)]
    assert a.bodies[0]["model"] == "m"


def test_a_failing_server_fails_the_run(servers):
    (a,) = servers(1, fail=True)
    wl = Workload("T", "one request", (Phase("p", (Request("r0", 0, 0, (5, 6, 7), 1),)),))
    with pytest.raises(endpoint.EndpointError, match="HTTP 500"):
        endpoint.run_workload(wl, [a.url], models=["m"], settle_s=0.5)


def test_unreachable_endpoint_is_named():
    with pytest.raises(endpoint.EndpointError, match="127.0.0.1:9"):
        endpoint.served_model("http://127.0.0.1:9", timeout_s=2)


def test_scrape_parsing_and_deltas():
    text = (
        "# TYPE kvtier_vllm_external_hit_tokens counter\n"
        'kvtier_vllm_external_hit_tokens_total{tier="disk"} 5.0\n'
        'kvtier_vllm_external_hit_tokens_total{tier="shared"} 7.0\n'
    )
    samples = {}
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[f"{s.name}{{tier={s.labels['tier']}}}"] = s.value
    after = dict(samples)
    after["kvtier_vllm_external_hit_tokens_total{tier=shared}"] += 10
    d = endpoint.delta(samples, after)
    assert d == {"kvtier_vllm_external_hit_tokens_total{tier=shared}": 10}
    assert endpoint.by_label(after, endpoint.HIT_TOKENS, "tier") == {"disk": 5, "shared": 17}
    assert endpoint.total(after, endpoint.HIT_TOKENS) == 22


def test_a_phase_settles_once_its_saves_are_written():
    """The next phase's lookups must find what this one saved: a phase
    ends once each tier that took saves has written, found or dropped as
    many chunks as the connector handed the store."""
    before = {"kvtier_vllm_saved_chunks_total": 4.0, "kvtier_stored_chunks_total{tier=memory}": 4.0,
              "kvtier_stored_chunks_total{tier=shared}": 4.0}
    after = dict(before)
    assert endpoint.writes_settled(before, after)  # nothing saved this phase
    after["kvtier_vllm_saved_chunks_total"] = 10.0  # 6 saved
    after["kvtier_stored_chunks_total{tier=memory}"] = 10.0
    after["kvtier_stored_chunks_total{tier=shared}"] = 7.0  # the shared tier's write-through runs behind
    assert not endpoint.writes_settled(before, after)
    after["kvtier_store_skipped_chunks_total{tier=shared}"] = 1.0
    after["kvtier_dropped_saves_total{reason=queue_full,tier=shared}"] = 2.0
    assert endpoint.writes_settled(before, after)  # 3 written, 1 already there, 2 dropped


def test_text_prompts_when_a_detokenizer_is_given(servers):
    (a,) = servers(1)
    wl = w3(sessions=2, context=300, vocab=500, instances=1, seed=0)
    out = endpoint.run_workload(wl, [a.url], detokenize=lambda ids: " ".join(map(str, ids)))
    assert out["prompts"] == "text"
    assert all(isinstance(b["prompt"], str) for b in a.bodies)
    assert a.bodies[0]["prompt"].split()[:3] == [str(t) for t in wl.phases[0].requests[0].tokens[:3]]
    resumes = [r for r in out["records"] if r["phase"] == "resume"]
    assert [r["cached_tokens"] for r in resumes] == [256, 256]


def test_as_resume_run_sums_phases_and_servers_under_offline_names(servers):
    a, b = servers(2)
    wl = w3(sessions=6, context=300, vocab=500, instances=2, seed=3)
    out = endpoint.run_workload(wl, [a.url, b.url])
    run = endpoint.as_resume_run(out, config="kvtier-shared", case="300")
    assert run["records"] is out["records"] and run["instances"] == 2
    assert run["measured"] == ["resume"] and set(run["span_s"]) == {"warm", "resume"}
    hits = sum(r["cached_tokens"] for r in out["records"])
    assert hits > 0
    assert run["kvtier_metrics"]["kvtier_vllm_external_hit_tokens_total{tier=shared}"] == hits
    assert run["vllm_metrics"]["vllm:external_prefix_cache_hits"] == hits
    assert run["vllm_metrics"]["vllm:request_success{finished_reason=length}"] == 12


# ------------------------------------------------------------------ events routing


@pytest.fixture
def kv_engines():
    """``kv_engines(n)``: vLLM's own KV-event publishers with replay
    endpoints (tests/routing/support.py), as engines run them."""
    from tests.routing.support import Engine

    made = []

    def make(n: int):
        made.extend(Engine(replay=True) for _ in range(n))
        return made[-n:]

    yield make
    for e in made:
        e.close()


def test_events_routing_sends_each_request_where_the_longest_hit_is(servers, kv_engines):
    from tests.routing.support import prompt, stored

    urls = [s.url for s in servers(3)]
    e0, e1, e2 = kv_engines(3)
    p0, p1, p2 = prompt(1, 3), prompt(2, 2), prompt(3, 2)
    e2.publish(stored([1, 2, 3], None, p0[:48]))
    e1.publish(stored([9], None, p0[:16]),
               stored([5, 6], None, p1[:32], medium="STORAGE", locality="LOCAL", ownership="disk"))
    e0.publish(stored([7, 8], None, p1[:32], medium="CPU", locality="LOCAL", ownership="memory"))
    time.sleep(0.5)  # published before the router exists: it learns them from the engines' replay buffers
    reqs = tuple(Request(f"r{i}", i, 0, tuple(p), 1) for i, p in enumerate((p0, p1, p2)))
    routing = "events=" + ",".join(e.spec for e in (e0, e1, e2))
    out = endpoint.run_workload(Workload("E", "events", (Phase("p", reqs),)), urls, routing=routing, settle_s=2)

    where = {r["id"]: r["endpoint"] for r in out["records"]}
    assert where["r0"] == 2  # 48 tokens there, 16 on server 1
    assert where["r1"] == 0  # 32 tokens in server 0's host memory, 32 on server 1's disk
    assert out["routing"] == routing
    assert [(s["batches"], s["events"], s["recovered"], s["gaps"]) for s in out["events"]] == \
        [(1, 1, 1, 0), (1, 2, 1, 0), (1, 1, 1, 0)]
    assert [s["events_endpoint"] for s in out["events"]] == [e0.url, e1.url, e2.url]
    for srv in out["phases"][0]["servers"]:
        assert srv["summary"]["events"] == {"batches": 0, "events": 0, "missed": 0, "lag_s_mean": 0.0}


def test_a_phase_reports_the_events_its_servers_published(servers, kv_engines):
    """Events published while a phase runs are counted in its summary."""
    from tests.routing.support import prompt, stored

    (url,) = [s.url for s in servers(1)]
    (e,) = kv_engines(1)
    be = endpoint.EndpointBackend([url], ["m"], routing=f"events={e.spec}")
    with be:
        e.join(be.kv_events.subscribers[0])
        before = be.kv_events.stats()
        e.send(be.kv_events.subscribers[0], stored([1], None, prompt(1, 1)[:16]))
        d = endpoint.events_delta(before[0], be.kv_events.stats()[0])
    assert d["batches"] == 1 and d["events"] == 1 and d["missed"] == 0 and 0 <= d["lag_s_mean"] < 5


@pytest.mark.parametrize("routing, problem", [
    ("events", "one KV-event endpoint per server"),
    ("events=tcp://127.0.0.1:1", "one KV-event endpoint per server"),
    ("sticky=tcp://127.0.0.1:1,tcp://127.0.0.1:2", "only events takes endpoints"),
    ("nearest", "use one of"),
])
def test_a_bad_routing_is_named(routing, problem):
    with pytest.raises(ValueError, match=problem):
        endpoint.EndpointBackend(["http://a:1", "http://b:1"], ["m", "m"], routing=routing)


@pytest.mark.parametrize("args, key", [
    (["--routing", "events"], "--events"),
    (["--routing", "sticky", "--events", "tcp://a:5557"], "--events"),
    (["--routing", "events", "--events", "tcp://a:5557,tcp://b:5557,tcp://c:5557"], "--events"),
    (["--routing", "events", "--events", "tcp://*:5557,tcp://b:5557"], "--events"),
])
def test_the_cli_refuses_events_routing_it_cannot_run(args, key, capsys, tmp_path):
    from kvtier import cli

    argv = ["bench", "resume", "--dir", str(tmp_path), "--endpoint", "http://a:8000", "--endpoint", "http://b:8000"]
    assert cli.main(argv + args) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "Fix:" in err and "Traceback" not in err
