"""Benchmark workloads against live OpenAI-compatible servers (``vllm serve``,
``kvtier serve``), the way clients see them.

    run_workload(workload, ["http://node1:8000", "http://node2:8000"],
                 routing="workload") -> dict
    as_resume_run(result) -> dict   # the shape of one ``kvtier bench resume`` run

Each request is one streaming ``POST /v1/completions`` with the prompt as
token ids (vLLM takes a list of ints as ``prompt``), greedy, ``ignore_eos``
(the workload sets every answer's length: a trace replay), and
``return_token_ids`` so that outputs can be compared token by token. TTFT is
client-side, from the send to the first streamed chunk that carries a token.
``cached_tokens`` is the server's ``usage.prompt_tokens_details.cached_tokens``
(vLLM reports it with ``--enable-prompt-tokens-details``; 0 otherwise).

Servers that do not take token ids get text instead: pass ``detokenize``, a
function from token ids to text (e.g. a Hugging Face tokenizer's ``decode``
for the served model). The server tokenizes that text again, so its prompt
can differ from the workload's by a few tokens at the edges; prefix sharing
between requests is kept, since equal token prefixes decode to equal text.

Routing (which server serves a request):
    workload  ``Request.instance`` (modulo the number of endpoints): W3's
              random placement, replayed identically on every run
    random    uniformly at random per request (seeded)
    sticky    a session's first request picks a server at random (seeded);
              every later request of that session, in every phase, goes there
    events=URL,URL,...
              cache-aware: one KV-event stream per server, in the same order
              (``tcp://node1:5557``, the engine's ``--kv-events-config``
              endpoint); each request goes where the events predict the
              longest prefix hit, in the fastest medium, on the least busy
              server (``kvtier.routing``); needs vLLM's package on the client
              for its event types. Each phase's server summary has
              ``events``: batches and events received, sequence gaps and the
              mean lag from the engine's timestamp to this client; the
              result's ``events`` has the subscribers' totals.

Each endpoint's ``/metrics`` is scraped before and after every phase, so a
phase's hits are attributed per server and per tier: kvtier's
``kvtier_vllm_external_hit_tokens_total{tier}`` (kvtier serve exposes it on
the server's ``/metrics``), vLLM's ``vllm:external_prefix_cache_hits_total``,
``vllm:prefix_cache_hits_total`` (its own prefix cache) and prompt-token
counters. Before the "after" scrape, the client waits until each server's
``vllm:request_success_total`` has counted every request it was sent, so that
the counters include the phase's last requests.

What a live run cannot do: drop the servers' memory tiers and page cache
before a ``cold`` phase (the in-process runner can). The result says so in
``notes``; for cold reads from the shared tier, run the servers without a
memory tier.

Requests run on a thread each (bounded pool), with ``http.client``; the
driver (``kvtier.bench.driver``) decides when each is sent.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.driver import run_phase
from kvtier.bench.workloads import Request, Workload

ROUTINGS = ("workload", "random", "sticky", "events")
# Labels that only say which model/engine of a server a sample is from: summed over.
_DROP_LABELS = ("engine", "model_name", "pid")
# Counters the report reads per server and phase (deltas); all other counter
# samples of kvtier_* and vllm:* are kept in "metrics" too.
HIT_TOKENS = "kvtier_vllm_external_hit_tokens_total"
VLLM_COUNTERS = {
    "external_prefix_cache_hits": "vllm:external_prefix_cache_hits_total",
    "external_prefix_cache_queries": "vllm:external_prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prompt_tokens_cached": "vllm:prompt_tokens_cached_total",
    "requests": "vllm:request_success_total",
}


class EndpointError(RuntimeError):
    """A server answered a request with an error, or could not be reached."""


def parse_routing(routing: str, servers: int) -> tuple[str, list[str]]:
    """``routing`` as (its name, the events endpoints): ``events=URL,URL``
    names one KV-event endpoint per server; the other routings take none."""
    name, eq, spec = routing.partition("=")
    if name not in ROUTINGS:
        raise ValueError(f"routing {routing!r}: use one of {', '.join(ROUTINGS)}")
    events = [u for u in spec.split(",") if u] if eq else []
    if name == "events" and len(events) != servers:
        raise ValueError(f"routing {routing!r}: events=URL,... needs one KV-event endpoint per server "
                         f"({servers}), in the servers' order")
    if name != "events" and eq:
        raise ValueError(f"routing {routing!r}: only events takes endpoints")
    return name, events


def _split(url: str) -> tuple[str, int, str]:
    u = urlsplit(url if "://" in url else f"http://{url}")
    if u.scheme not in ("http", "https"):
        raise ValueError(f"endpoint {url!r}: only http:// and https:// URLs")
    return u.scheme, u.port or (443 if u.scheme == "https" else 80), u.hostname or "localhost"


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    scheme, port, host = _split(url)
    base = urlsplit(url if "://" in url else f"http://{url}").path.rstrip("/")
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    return cls(host, port, timeout=timeout_s), base


def http_get(url: str, path: str, timeout_s: float = 30.0) -> bytes:
    conn, base = _connection(url, timeout_s)
    try:
        conn.request("GET", base + path)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise EndpointError(f"GET {url}{path}: HTTP {resp.status}: {body[:300]!r}")
        return body
    except OSError as exc:
        raise EndpointError(f"GET {url}{path}: {exc}") from exc
    finally:
        conn.close()


def served_model(url: str, timeout_s: float = 30.0) -> str:
    """The first model id the server lists at ``/v1/models``."""
    data = json.loads(http_get(url, "/v1/models", timeout_s))["data"]
    if not data:
        raise EndpointError(f"{url}/v1/models lists no model")
    return data[0]["id"]


# ------------------------------------------------------------------ metrics


def scrape(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Counter samples of ``kvtier_*`` and ``vllm:*`` (histograms' ``_sum``
    and ``_count`` too) from ``url``/metrics, as ``{"name{k=v,...}": value}``
    with labels sorted and engine/model/pid labels summed over."""
    text = http_get(url, "/metrics", timeout_s).decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if not (fam.name.startswith("kvtier") or fam.name.startswith("vllm:")):
            continue
        if fam.type not in ("counter", "histogram"):
            continue
        for s in fam.samples:
            if fam.type == "histogram" and not s.name.endswith(("_sum", "_count")):
                continue
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in _DROP_LABELS)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Non-zero differences ``after - before`` (a sample absent before is 0)."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d:
            out[k] = d
    return out


def total(samples: dict[str, float], name: str) -> float:
    """Sum of every sample of ``name`` (all label values)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def by_label(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``{label value: sum}`` over the samples of ``name``."""
    out: dict[str, float] = {}
    for k, v in samples.items():
        if k.startswith(name + "{") and k.endswith("}"):
            labels = dict(kv.split("=", 1) for kv in k[len(name) + 1:-1].split(",") if "=" in kv)
            if label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
    return out


def summarise_delta(d: dict[str, float]) -> dict:
    """What a phase did on one server: kvtier's hits by tier, vLLM's counters."""
    return {"kvtier_hit_tokens_by_tier": by_label(d, HIT_TOKENS, "tier"),
            "cached_by_source": by_label(d, "vllm:prompt_tokens_cached_by_source_total", "source"),
            **{k: total(d, name) for k, name in VLLM_COUNTERS.items()}}


# ------------------------------------------------------------------ backend


class EndpointBackend:
    """A driver ``Backend`` (see ``kvtier.bench.driver``) over live servers.

    ``send`` hands the request to a thread that streams it; ``poll`` returns
    the events those threads queued. A request that fails raises
    ``EndpointError`` from ``poll`` (on the driver's thread): a benchmark
    with failed requests has no meaning. ``served`` maps request id to the
    index of the endpoint that served it. ``routing``: a name of
    ``ROUTINGS``, ``events=URL,...`` with one KV-event endpoint per server.
    Use it with ``with`` (or ``start()`` before the first ``send`` and
    ``close()`` at the end): the events routing's subscribers run between.
    """

    def __init__(self, endpoints: list[str], models: list[str], routing: str = "workload", *, seed: int = 0,
                 timeout_s: float = 600.0, ignore_eos: bool = True, max_workers: int = 64,
                 detokenize: Callable[[tuple[int, ...]], str] | None = None):
        if not endpoints or len(models) != len(endpoints):
            raise ValueError("one model name per endpoint, at least one endpoint")
        self.routing, events = parse_routing(routing, len(endpoints))
        self.endpoints = list(endpoints)
        self.models = list(models)
        self.timeout_s = timeout_s
        self.ignore_eos = ignore_eos
        self.detokenize = detokenize
        self.served: dict[str, int] = {}
        self._rng = random.Random(seed)
        self._sticky: dict[int, int] = {}
        self._events: queue.Queue = queue.Queue()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvtier-endpoint")
        self._closed = threading.Event()
        self.kv_events = None  # the events routing: its subscribers run from start() to close()
        if events:
            from kvtier.routing.live import EventsRouting

            self.kv_events = EventsRouting(events, seed=seed)

    def start(self) -> None:
        """Start the events routing's subscribers (``with`` does it)."""
        if self.kv_events is not None:
            self.kv_events.start()

    def route(self, request: Request) -> int:
        n = len(self.endpoints)
        if self.kv_events is not None:
            return self.kv_events.choose(request.tokens).instance
        if self.routing == "workload":
            return request.instance % n
        if self.routing == "random":
            return self._rng.randrange(n)
        if request.session not in self._sticky:
            self._sticky[request.session] = self._rng.randrange(n)
        return self._sticky[request.session]

    def send(self, request: Request) -> None:
        k = self.route(request)
        self.served[request.id] = k
        if self.kv_events is not None:
            self.kv_events.begin(k)
        self._pool.submit(self._stream, request, k)

    def poll(self, timeout_s: float) -> list[tuple]:
        out = []
        try:
            out.append(self._events.get(timeout=max(0.0, timeout_s)))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        for ev in out:
            if ev[0] == "error":
                raise EndpointError(ev[3])
        return out

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.kv_events is not None:
            self.kv_events.close()

    def __enter__(self) -> EndpointBackend:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, request: Request, k: int) -> None:
        """One request, on a pool thread: every outcome becomes an event."""
        url = self.endpoints[k]
        try:
            self._events.put(self._do_stream(request, url, self.models[k]))
        except Exception as exc:  # reported to the driver's thread by poll()
            self._events.put(("error", request.id, time.perf_counter(), f"{request.id} on {url}: {exc}"))
        finally:
            if self.kv_events is not None:
                self.kv_events.end(k)

    def _do_stream(self, request: Request, url: str, model: str) -> tuple:
        body = {
            "model": model, "max_tokens": request.max_tokens,
            "prompt": self.detokenize(request.tokens) if self.detokenize else list(request.tokens),
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "ignore_eos": self.ignore_eos,
        }
        conn, base = _connection(url, self.timeout_s)
        tokens: list[int] = []
        cached = 0
        first = False
        try:
            conn.request("POST", base + "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise EndpointError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise EndpointError(str(chunk["error"])[:500])
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    if (ids or choice.get("text")) and not first:
                        first = True
                        self._events.put(("first", request.id, time.perf_counter()))
                    tokens.extend(ids)
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    cached = int(details["cached_tokens"])
        finally:
            conn.close()
        return ("done", request.id, time.perf_counter(), {"tokens": tokens, "cached_tokens": cached})


# ------------------------------------------------------------------ a whole workload


# What kvtier's store counts once a save reached a tier (written, already
# there, or dropped with a reason), against what the connector handed it.
SAVED_CHUNKS = "kvtier_vllm_saved_chunks_total"
_SAVE_OUTCOMES = ("kvtier_stored_chunks_total", "kvtier_store_skipped_chunks_total", "kvtier_dropped_saves_total")


def writes_settled(before: dict[str, float], after: dict[str, float]) -> bool:
    """Whether every tier that took saves this phase has accounted for all
    the chunks the server's connector handed its store (written, found
    there, or dropped): a tier's write-through runs behind the requests
    that made it, and the next phase's lookups must find what this one
    wrote."""
    saved = total(after, SAVED_CHUNKS) - total(before, SAVED_CHUNKS)
    if saved <= 0:
        return True
    done: dict[str, float] = {}
    for name in _SAVE_OUTCOMES:
        was = by_label(before, name, "tier")
        for tier, v in by_label(after, name, "tier").items():
            done[tier] = done.get(tier, 0.0) + v - was.get(tier, 0.0)
    return all(n >= saved for n in done.values() if n > 0)


def _settle(endpoints: list[str], before: list[dict], expected: list[int], timeout_s: float) -> list[dict]:
    """Scrape every endpoint until its request counter has counted the
    requests it was sent this phase (vLLM records stats just after it
    streams the last chunk) and its tiers have written what the phase saved
    (``writes_settled``), or ``timeout_s`` passes."""
    end = time.monotonic() + timeout_s
    while True:
        after = [scrape(u) for u in endpoints]
        done = all(total(a, VLLM_COUNTERS["requests"]) - total(b, VLLM_COUNTERS["requests"]) >= n
                   and writes_settled(b, a) for a, b, n in zip(after, before, expected))
        if done or time.monotonic() > end:
            return after
        time.sleep(0.1)


def run_workload(workload: Workload, endpoints: list[str], routing: str = "workload",
                 progress: Callable[[str, int], Callable[[int], None]] | None = None, *,
                 models: list[str] | None = None, seed: int = 0, timeout_s: float = 600.0,
                 ignore_eos: bool = True, block_tokens: int = 256, settle_s: float = 10.0,
                 detokenize: Callable[[tuple[int, ...]], str] | None = None,
                 before_cold: Callable[[], str] | None = None) -> dict:
    """Run ``workload``'s phases in order against ``endpoints`` (base URLs,
    e.g. ``http://10.0.0.1:8000``) and return::

        {"workload": name, "description", "params", "endpoints": [...], "routing", "models": [...],
         "phases": [{"name", "measured", "cold", "wall_s", "requests": n,
                     "servers": [{"endpoint", "requests", "metrics": {delta}, "summary": {...}}]}],
         "records": [driver records + "endpoint" (index) and "server" (URL)],
         "notes": [...], "events": [per server, with routing events=...]}

    ``summary`` per server and phase: ``kvtier_hit_tokens_by_tier`` (from
    ``kvtier_vllm_external_hit_tokens_total``), ``cached_by_source``,
    ``external_prefix_cache_hits``, ``prefix_cache_hits``, ``prompt_tokens``,
    ``requests`` ... (deltas over the phase), and with ``events=`` routing
    ``events`` (``events_delta``). ``routing``: see the module docstring.
    ``progress(desc, total)``
    returns a ``tick(n)`` called once per finished request, as in
    ``kvtier bench resume``. ``models``: the model name per endpoint (default:
    what each lists at ``/v1/models``). ``detokenize``: send text made from
    the token ids instead of the ids (see the module docstring).
    ``before_cold``: called before each cold phase, once the phase before
    settled, by a caller that can make the phase colder on the servers'
    host (drop a shared folder's files from the page cache); it returns the
    note that says what it did, in place of the note that cold phases run
    warm.
    """
    if not endpoints:
        raise ValueError("no endpoint given")
    models = list(models) if models else [served_model(u) for u in endpoints]
    notes = []
    if routing == "workload" and workload.instances > len(endpoints):
        notes.append(f"the workload places requests on {workload.instances} instances but {len(endpoints)} "
                     f"endpoints were given: instance i goes to endpoint i mod {len(endpoints)}")
    if any(p.cold for p in workload.phases) and before_cold is None:
        notes.append("cold phases run warm here: a live run cannot drop the servers' memory tiers or page "
                     "cache; run the servers without a memory tier to measure loads from the shared tier")
    tick = (progress or (lambda d, t: (lambda n: None)))(
        f"{workload.name} requests", sum(len(p.requests) for p in workload.phases))
    phases, records = [], []
    with EndpointBackend(endpoints, models, routing, seed=seed, timeout_s=timeout_s, ignore_eos=ignore_eos,
                         detokenize=detokenize) as be:
        for phase in workload.phases:
            if phase.cold and before_cold is not None:
                note = before_cold()
                if note not in notes:
                    notes.append(note)
            before = [scrape(u) for u in endpoints]
            events_before = be.kv_events.stats() if be.kv_events else None
            t0 = time.perf_counter()

            def done(rec: dict) -> None:
                k = be.served[rec["id"]]
                rec["endpoint"], rec["server"] = k, endpoints[k]
                tick(1)

            recs = run_phase(phase, be, block_tokens=block_tokens, on_done=done)
            wall = time.perf_counter() - t0
            sent = [sum(1 for r in recs if r["endpoint"] == k) for k in range(len(endpoints))]
            after = _settle(endpoints, before, sent, settle_s)
            servers = []
            events_after = be.kv_events.stats() if be.kv_events else None
            for k, url in enumerate(endpoints):
                d = delta(before[k], after[k])
                summary = summarise_delta(d)
                if events_after:
                    summary["events"] = events_delta(events_before[k], events_after[k])
                servers.append({"endpoint": url, "requests": sent[k], "metrics": d, "summary": summary})
            phases.append({"name": phase.name, "measured": phase.measured, "cold": phase.cold, "wall_s": wall,
                           "requests": len(recs), "servers": servers})
            records.extend(recs)
        events = be.kv_events.stats() if be.kv_events else None
    out = {"workload": workload.name, "description": workload.description, "params": workload.params,
           "endpoints": list(endpoints), "routing": routing, "models": models,
           "prompts": "text" if detokenize else "token ids",
           "phases": phases, "records": records, "notes": notes}
    if events:
        out["events"] = events
    return out


def events_delta(before: dict, after: dict) -> dict:
    """What one server's KV-event stream delivered during a phase: batches
    and events handed to the index, sequence numbers missed (at join and
    in gaps, less those recovered by replay) and the mean lag of the live
    batches."""
    d = {k: after[k] - before[k] for k in ("batches", "events", "missed_at_join", "gaps", "recovered", "lag_s_sum")}
    live = d["batches"] - d["recovered"]
    return {"batches": d["batches"], "events": d["events"],
            "missed": d["missed_at_join"] + d["gaps"] - d["recovered"],
            "lag_s_mean": d["lag_s_sum"] / live if live > 0 else 0.0}


def as_resume_run(result: dict, config: str = "endpoint", case: str = "", rnd: int = 0) -> dict:
    """A ``run_workload`` result in the shape of one configuration's run of
    ``kvtier bench resume`` (what its report reads): records, measured
    phases, phase spans, and the metric deltas summed over phases and
    servers, ``kvtier_*`` as scraped and ``vllm:*`` named as vLLM's offline
    ``get_metrics()`` names them (``vllm:external_prefix_cache_hits``, no
    ``_total``)."""
    kv: dict[str, float] = {}
    vm: dict[str, float] = {}
    for ph in result["phases"]:
        for srv in ph["servers"]:
            for key, v in srv["metrics"].items():
                if key.startswith("kvtier"):
                    kv[key] = kv.get(key, 0.0) + v
                elif key.startswith("vllm:"):
                    name, brace, labels = key.partition("{")
                    key = name.removesuffix("_total") + brace + labels
                    vm[key] = vm.get(key, 0.0) + v
    return {
        "config": config, "case": case, "round": rnd, "instances": len(result["endpoints"]),
        "records": result["records"],
        "measured": sorted(p["name"] for p in result["phases"] if p["measured"]),
        "span_s": {p["name"]: p["wall_s"] for p in result["phases"]},
        "kvtier_metrics": kv, "vllm_metrics": vm,
    }
