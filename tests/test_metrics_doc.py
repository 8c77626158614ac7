"""docs/metrics.md lists every metric kvtier exports, as it exports it, and
the docs name no metric that does not exist.

The exported metrics come from kvtier itself: the store's ``Metrics`` and
the vLLM connector's ``ConnectorMetrics`` are built on registries of their
own (neither needs vLLM), and the source is scanned for any other
prometheus_client metric, so that one registered elsewhere is caught too.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from kvtier.integrations.vllm.metrics import ConnectorMetrics
from kvtier.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
_DEFINED = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary|Info|Enum)\(\s*f?([\"'])(.+?)\1")
_ROW = re.compile(r"^\|\s*`(kvtier_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|\s*([a-z_, ]*?)\s*\|\s*(\S.*?)\s*\|\s*$", re.MULTILINE)
_NAME = re.compile(r"(?<![A-Za-z0-9_])kvtier_[a-z0-9_]*[a-z0-9](?:_?\*)?")  # kvtier_vllm_*: a family

# kvtier_* words in the docs that are not metrics, and where each is defined.
NOT_METRICS = {
    "kvtier_sqlite": "examples/sqlite_tier/kvtier_sqlite.py",  # the example tier plugin's module
    "kvtier_hit_tokens_by_tier": "kvtier/bench/endpoint.py",  # a field of kvtier bench resume --endpoint's JSON
    "kvtier_load_s_mean": "kvtier/bench/resume_report.py",  # fields of kvtier bench resume's JSON
    "kvtier_read_cpu_s": "kvtier/bench/resume_report.py",
    "kvtier_read_cpu_s_per_gb": "kvtier/bench/resume_report.py",
}


def base(name: str) -> str:
    """A sample's or a definition's metric name, as Prometheus groups them."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exported() -> dict[str, MetricWrapperBase]:
    """Every metric the store and the connector register, by base name."""
    out = {}
    for owner in (Metrics(CollectorRegistry()), ConnectorMetrics(CollectorRegistry())):
        for m in vars(owner).values():
            if isinstance(m, MetricWrapperBase):
                out[m._name] = m
    return out


def defined_in_source() -> set[str]:
    """Base names of every prometheus_client metric constructed in kvtier's
    modules that import prometheus_client (``{p}`` is the store's prefix,
    ``kvtier``)."""
    names = set()
    for path in (ROOT / "kvtier").rglob("*.py"):
        text = path.read_text()
        if not re.search(r"^\s*(?:from|import) prometheus_client\b", text, re.MULTILINE):
            continue
        for m in _DEFINED.finditer(text):
            names.add(base(m.group(2).replace("{p}", "kvtier")))
    return names


def documented_rows() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """docs/metrics.md's table rows: name as exposed -> (type, labels, meaning)."""
    rows = {}
    for name, kind, labels, meaning in _ROW.findall(DOC.read_text()):
        assert name not in rows, f"docs/metrics.md lists {name} twice"
        rows[name] = (kind, tuple(x.strip() for x in labels.split(",") if x.strip()), meaning)
    return rows


def exposed_name(m: MetricWrapperBase) -> str:
    return m._name + "_total" if m._type == "counter" else m._name


def test_the_scan_finds_every_registered_metric():
    assert len(exported()) >= 30
    assert set(exported()) <= defined_in_source()


def test_every_metric_in_kvtiers_source_is_registered_by_metrics_or_the_connector():
    """A metric built elsewhere would escape the table check below."""
    assert defined_in_source() == set(exported())


def test_every_exported_metric_has_a_row_with_its_type_and_labels():
    rows = documented_rows()
    missing, wrong = [], []
    for m in exported().values():
        name = exposed_name(m)
        if name not in rows:
            missing.append(name)
            continue
        kind, labels, meaning = rows[name]
        if kind != m._type or labels != tuple(m._labelnames) or len(meaning) < 10:
            wrong.append(f"{name}: documented {kind} {labels}, exported {m._type} {tuple(m._labelnames)}")
    assert not missing, "docs/metrics.md has no row for: " + ", ".join(sorted(missing))
    assert not wrong, "docs/metrics.md disagrees with the code:\n  " + "\n  ".join(wrong)


def test_every_row_is_an_exported_metric():
    names = {exposed_name(m) for m in exported().values()}
    assert not set(documented_rows()) - names


def test_the_docs_name_only_real_metrics():
    real = set(exported())
    unknown = []
    for page in DOC_PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for word in _NAME.findall(line):
                if word.endswith("*"):
                    known = any(r.startswith(word.rstrip("*")) for r in real)
                else:
                    known = base(word) in real or word in NOT_METRICS
                if not known:
                    unknown.append(f"{page.relative_to(ROOT)}:{n}: {word}")
    assert not unknown, "no such metric:\n  " + "\n  ".join(unknown)


def test_the_words_that_are_not_metrics_are_defined_where_said():
    for word, path in NOT_METRICS.items():
        assert word not in {base(n) for n in exported()}, word
        assert re.search(rf"\b{word}\b", (ROOT / path).read_text()), f"{word} is no longer in {path}"


def test_suffixes_strip_as_prometheus_groups_samples():
    assert base("kvtier_op_seconds_bucket") == "kvtier_op_seconds"
    assert base("kvtier_hit_tokens_total") == "kvtier_hit_tokens"
    assert base("kvtier_vllm_load_seconds_count") == "kvtier_vllm_load_seconds"
