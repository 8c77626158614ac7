"""GuideLLM (PyPI ``guidellm``), the published benchmark client that
``kvtier bench client`` runs against each server: its command line for a
multi-turn workload, and the figures read back from its JSON report.

GuideLLM's ``synthetic_text`` data makes conversations: a first turn of
``prefix_tokens`` (one system prompt shared by every conversation) plus
``prompt_tokens`` of user text, then ``turns - 1`` more turns, each resent
with the whole history as text (earlier prompts and the server's answers)
after a think time of ``delay`` seconds. Its ``concurrent`` profile keeps
``streams`` requests in flight and starts further conversations while
others think, so more sessions are open than the engine's KV holds: a
returning session finds its prefix evicted from vLLM's own cache, which is
what a KV tier is for. ``max_requests`` stops it after every turn of
``sessions`` conversations has been sent.

Prompts are text, tokenized by GuideLLM with the served model's tokenizer
directory (``kvtier.bench.bytetok``: one token per byte, so a resent
history is a token-for-token prefix of the next turn).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.errors import ConfigError

VERSION_SPEC = "guidellm>=0.8.1,<0.9"
INSTALL_HINT = "pip install 'kvtier[client]'   (or: pip install '" + VERSION_SPEC + "')"
# A tokenizer's answer token decodes to at most this many bytes (bytetok:
# 1 for a byte, 3 for a token above 255), each a token again in the history.
ANSWER_BYTES_PER_TOKEN = 3


@dataclass(frozen=True)
class Workload:
    """What GuideLLM sends; the same for both servers."""

    sessions: int = 8          # conversations
    turns: int = 4             # requests per conversation
    prefix_tokens: int = 512   # system prompt shared by all conversations (0: none)
    prompt_tokens: int = 256   # user text per turn
    output_tokens: int = 32    # answer per turn (ignore_eos: always this long)
    think_s: float = 2.0       # mean think time between a conversation's turns, seconds (0: none)
    concurrency: int = 2       # requests in flight
    seed: int = 0

    def validate(self) -> None:
        for key, value, low in (("--sessions", self.sessions, 1), ("--turns", self.turns, 1),
                                ("--prefix-tokens", self.prefix_tokens, 0), ("--prompt-tokens", self.prompt_tokens, 1),
                                ("--output-tokens", self.output_tokens, 1), ("--concurrency", self.concurrency, 1)):
            if value < low:
                raise ConfigError(key, f"must be at least {low}, got {value}", f"pass {key} {max(low, 1)} or more")
        if self.think_s < 0:
            raise ConfigError("--think", f"must be 0 or more seconds, got {self.think_s}", "pass --think 2, say")

    @property
    def requests(self) -> int:
        return self.sessions * self.turns

    def longest_prompt(self) -> int:
        """Tokens of a conversation's last prompt, at most: the prefix, every
        turn's text, every earlier answer as re-tokenized text, and the
        spaces GuideLLM joins them with."""
        answers = (self.turns - 1) * self.output_tokens * ANSWER_BYTES_PER_TOKEN
        return self.prefix_tokens + self.turns * self.prompt_tokens + answers + 2 * self.turns

    def as_dict(self) -> dict:
        return asdict(self)


def find(explicit: str | None = None) -> str | None:
    """The ``guidellm`` command: ``explicit``, else the one installed next to
    this Python (``kvtier[client]``), else the first on ``PATH``."""
    if explicit:
        path = Path(explicit)
        return str(path) if path.is_file() else shutil.which(explicit)
    beside = Path(sys.executable).parent / "guidellm"
    return str(beside) if beside.exists() else shutil.which("guidellm")


def command(exe: str, url: str, model_name: str, tokenizer_dir: Path, wl: Workload, out_json: Path) -> list[str]:
    """GuideLLM's ``run`` for ``wl`` against the server at ``url``."""
    data = [f"prompt_tokens={wl.prompt_tokens}", f"output_tokens={wl.output_tokens}", f"turns={wl.turns}"]
    if wl.think_s > 0:
        data.append(f"delay={wl.think_s:g}")
    if wl.prefix_tokens > 0:
        data += [f"prefix_tokens={wl.prefix_tokens}", "prefix_count=1"]
    return [
        exe, "run",
        "--backend", f"kind=openai_http,target={url},request_format=/v1/completions,model={model_name}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--data", "kind=synthetic_text," + ",".join(data),
        "--profile", f"kind=concurrent,streams={wl.concurrency}",
        "--constraint", f"kind=max_requests,count={wl.requests}",
        "--seed", f"kind=static,value={wl.seed}",
        "--output", f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]


def _stat(metrics: dict, name: str, status: str = "successful") -> dict:
    return (metrics.get(name) or {}).get(status) or {}


def summarise(report_path: Path) -> dict:
    """The figures ``kvtier bench client`` compares, from GuideLLM's JSON
    report: requests by outcome, TTFT percentiles (ms, successful requests),
    and the throughputs GuideLLM prints (means over the run)."""
    report = json.loads(Path(report_path).read_text())
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals") or {}
    pct = _stat(m, "time_to_first_token_ms").get("percentiles") or {}
    return {
        "requests_ok": int(totals.get("successful", 0)),
        "requests_failed": int(totals.get("errored", 0)),
        "requests_incomplete": int(totals.get("incomplete", 0)),
        "ttft_ms": {p: pct.get(p) for p in ("p50", "p90", "p99")},
        "output_tokens_per_s": _stat(m, "output_tokens_per_second", "total").get("mean"),
        "requests_per_s": _stat(m, "requests_per_second", "total").get("mean"),
        "prompt_tokens_mean": _stat(m, "prompt_token_count").get("mean"),
        "duration_s": bench.get("duration"),
        "version": (report.get("metadata") or {}).get("guidellm_version", "unknown"),
    }
