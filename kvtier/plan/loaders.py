"""Trace loaders: every format to ``Request`` in arrival order.

Formats (JSON Lines, one request per line):

    mooncake  Mooncake FAST'25 (kvcache-ai/Mooncake, FAST25-release/traces):
              timestamp (ms from the trace start), input_length,
              output_length, hash_ids (one per 512-token block, the last block
              may be partial). No sessions; an optional "session_id" is used.
    bailian   Alibaba Bailian (alibaba-edu/qwen-bailian-usagetraces-anon):
              chat_id, parent_chat_id (-1 for a first turn), timestamp
              (seconds), input_length, output_length, type, turn, hash_ids
              (one per 16-token block). A session is the chain of parents.
    kvtier    the request log of ``kvtier bench resume`` (requests.jsonl): the
              driver's records (t_send, prompt_tokens, output_tokens,
              hash_ids of block_tokens blocks, session, turn, instance, phase,
              ttft_s, cached_tokens, output) plus "workload" and "config".

``load`` detects the format from the first record unless told.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.plan.traces import ROOT, Request, Trace, to_units

FORMATS = ("mooncake", "bailian", "kvtier")
_OUT = 0x6F7574  # tags are ints: hashes of int tuples do not depend on PYTHONHASHSEED
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}


def detect(record: dict) -> str:
    if "t_send" in record and "hash_ids" in record:
        return "kvtier"
    if "chat_id" in record:
        return "bailian"
    if "timestamp" in record and "hash_ids" in record:
        return "mooncake"
    raise ConfigError("trace", f"unknown trace record with keys {sorted(record)[:8]}",
                      f"use one of the formats {', '.join(FORMATS)} (see kvtier plan --help)")


def _lines(path: Path) -> Iterator[dict]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise ConfigError("trace", f"{path}:{n} is not JSON ({exc})", "give a JSON Lines file, one request per line") from None


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n


def load(path: str | Path, fmt: str = "auto", unit_tokens: int = 128, block_tokens: int | None = None,
         limit: int | None = None, config: str | None = None) -> Trace:
    """A trace from ``path``. ``block_tokens`` overrides the format's block
    size; ``limit`` keeps the first requests; ``config`` selects one
    configuration's records of a kvtier log (default: the first one seen)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("trace", f"{p} is not a file", "pass a JSON Lines trace (see kvtier plan --help)")
    if fmt == "auto":
        first = next(_lines(p), None)
        if first is None:
            raise ConfigError("trace", f"{p} is empty", "pass a trace with at least one request")
        fmt = detect(first)
    if fmt not in FORMATS:
        raise ConfigError("--format", f"unknown format {fmt!r}", f"use one of: auto, {', '.join(FORMATS)}")
    if fmt == "kvtier":
        return load_kvtier_log(p, unit_tokens, config=config, limit=limit)
    bt = block_tokens or BLOCK_TOKENS[fmt]
    reader = _mooncake if fmt == "mooncake" else _bailian
    count = _count_lines(p)
    if limit:
        count = min(count, limit)

    def open_() -> Iterator[Request]:
        it = reader(_lines(p), bt, unit_tokens)
        for i, r in enumerate(it):
            if limit and i >= limit:
                return
            yield r

    return Trace(p.name, unit_tokens, open_, count, {"format": fmt, "block_tokens": bt, "path": str(p)})


def _mooncake(records, bt: int, ut: int) -> Iterator[Request]:
    # Mooncake's traces name no sessions: each request is its own unless the
    # record has a "session_id". (Inferring sessions from extended prefixes
    # is ambiguous at 512-token blocks: a short turn adds no full block, and
    # the first request to extend a shared system prompt looks like its
    # continuation.)
    for i, r in enumerate(records):
        n_in = int(r["input_length"])
        yield Request(
            t=float(r["timestamp"]) / 1000.0,
            units=to_units(r["hash_ids"], bt, n_in, ut),
            prompt_tokens=n_in,
            output_tokens=int(r["output_length"]),
            session=r.get("session_id", f"r{i}"),
            id=str(i),
        )


def _bailian(records, bt: int, ut: int) -> Iterator[Request]:
    # A session is the root chat of a chain of parents. Parents come before
    # their children in a trace ordered by time; the map holds one int per chat.
    root_of: dict[int, int] = {}
    for r in records:
        chat, parent = int(r["chat_id"]), int(r.get("parent_chat_id", -1))
        root = root_of.get(parent, parent) if parent >= 0 else chat
        root_of[chat] = root
        n_in = int(r["input_length"])
        yield Request(
            t=float(r["timestamp"]),
            units=to_units(r["hash_ids"], bt, n_in, ut),
            prompt_tokens=n_in,
            output_tokens=int(r["output_length"]),
            session=root,
            turn=int(r.get("turn", 1)),
            id=str(chat),
            extra={"type": r.get("type", "")} if r.get("type") else {},
        )


def kvtier_request(r: dict, unit_tokens: int, t0: float = 0.0) -> Request:
    """One driver record (``kvtier.bench.driver.run_phase``) as a Request."""
    bt = int(r.get("block_tokens", 256))
    n_in = int(r["prompt_tokens"])
    out = r.get("output")
    out_key = hash((_OUT, tuple(out))) if out else None
    return Request(
        t=t0 + float(r["t_send"]),
        units=to_units(r["hash_ids"], bt, n_in, unit_tokens, salt=ROOT),
        prompt_tokens=n_in,
        output_tokens=int(r.get("output_tokens", 0)),
        session=r.get("session"),
        turn=int(r.get("turn", 0)),
        instance=r.get("instance"),
        id=str(r.get("id", "")),
        phase=str(r.get("phase", "")),
        output_key=out_key,
        t_done=t0 + float(r["t_done"]) if r.get("t_done") is not None else None,
        ttft_s=r.get("ttft_s"),
        cached_tokens=r.get("cached_tokens"),
        extra={k: r[k] for k in ("workload", "config", "queue_s", "t_done", "t_first") if k in r},
    )


def _fill_tails(reqs: list[Request], unit_tokens: int) -> None:
    """Whole units past a prompt's last logged block (the driver hashes blocks
    of ``block_tokens``, often a chunk: a prompt's last part-chunk of whole
    engine blocks has no id, though kvtier stores it).

    Where the next turn of the same session starts with every logged block of
    this turn, it is taken to extend this turn's prompt (as every turn of a
    chat workload does: history + answer + user turn), and its unit ids name
    the missing units. Logging ``block_tokens`` equal to the engine's block
    size makes this unnecessary."""
    by_session: dict = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: (r.turn, r.t))
        for a, b in itertools.pairwise(turns):
            n = a.prompt_tokens // unit_tokens
            if len(a.units) < n <= len(b.units) and b.prompt_tokens >= a.prompt_tokens \
                    and b.units[: len(a.units)] == a.units:
                a.units = b.units[:n]


def kvtier_records(path: Path) -> list[dict]:
    return list(_lines(Path(path)))


def load_kvtier_log(path: Path, unit_tokens: int, config: str | None = None, limit: int | None = None,
                    records: list[dict] | None = None) -> Trace:
    """Records of one configuration, in send order. Each phase's times are
    relative to its own start (the driver's ``t0``): phases are laid end to
    end, in the order they first appear, so that arrival times stay ordered."""
    recs = records if records is not None else kvtier_records(path)
    configs = list(dict.fromkeys(r.get("config") for r in recs))
    if config is None:
        config = configs[0] if configs else None
    elif config not in configs:
        raise ConfigError("--config", f"{path} has no records of configuration {config!r}",
                          f"use one of: {', '.join(str(c) for c in configs)}")
    recs = [r for r in recs if r.get("config") == config]
    # A bench run's cases (context lengths) and rounds ran in fresh engines
    # on empty stores: replay one of them, the first.
    runs = list(dict.fromkeys((r.get("case"), r.get("round")) for r in recs))
    case = runs[0] if runs else (None, None)
    if len(runs) > 1:
        recs = [r for r in recs if (r.get("case"), r.get("round")) == case]
    phases = list(dict.fromkeys(r.get("phase", "") for r in recs))
    reqs: list[Request] = []
    t0 = 0.0
    for ph in phases:
        rs = sorted((r for r in recs if r.get("phase", "") == ph), key=lambda r: r["t_send"])
        reqs += [kvtier_request(r, unit_tokens, t0) for r in rs]
        t0 = max([t0] + [t0 + float(r.get("t_done", r["t_send"])) for r in rs]) + 1.0
    _fill_tails(reqs, unit_tokens)
    if limit:
        reqs = reqs[:limit]
    workload = next((r.get("workload") for r in recs if r.get("workload")), None)
    return Trace.of(Path(path).name, unit_tokens, reqs, format="kvtier", config=config, workload=workload,
                    configs=configs, case=case[0], runs=len(runs), path=str(path))
