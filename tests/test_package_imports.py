"""No import cycle between kvtier's packages, and every package import goes
down its layers.

Nodes: ``kvtier.X`` for each module and package directly in ``kvtier/``
(``kvtier`` itself is the root's ``__init__``, and ``kvtier._readloop``,
the native read loop, which has no Python source). An edge X -> Y: a module
of X imports a module of Y, as ``test_imports.module_graph`` reads imports
(function-level ones included). The layers, bottom up; an edge goes only to
a lower layer, which rules out cycles by construction:

    0  version, errors, buffers, metrics, progress, concurrency, observe
    1  kvtier, keys, auth, configfields, routing
    2  codec
    3  tiers
    4  config
    5  argtypes, engine
    6  integrations, admin
    7  bench, serve
    8  plan
    9  check
    10 cli

The edges (``kvtier.`` left out; the layer-0 nodes import nothing of kvtier):

    kvtier        -> version
    keys          -> version
    auth          -> errors
    configfields  -> errors
    routing       -> errors
    codec         -> auth, buffers, errors, keys, version
    tiers         -> kvtier (_readloop), buffers, codec, concurrency, configfields, errors, keys, metrics,
                     observe
    config        -> configfields, errors, tiers
    argtypes      -> config, errors
    engine        -> auth, buffers, codec, concurrency, config, errors, keys, metrics, tiers
    integrations  -> codec, concurrency, config, engine, errors, keys, metrics, tiers
    admin         -> argtypes, auth, codec, config, errors, keys, progress, tiers
    bench         -> kvtier (its path), argtypes, auth, buffers, codec, config, engine, errors,
                     integrations, keys, observe, progress, routing, tiers, version
    serve         -> config, errors, integrations
    plan          -> argtypes, bench, config, errors, progress, tiers
    check         -> auth, codec, config, errors, integrations, serve, tiers, version
    cli           -> admin, bench, check, errors, plan, serve, version

So the store (``engine``) sits on the tiers and the tiers never reach back
up; both run their work on ``concurrency``; a tier's config is written with
``configfields``, beneath ``config``, which finds tier kinds through the
tiers' registry. A failure prints the edges as they are.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_imports import ROOT, cycles, module_graph

LAYERS = (
    ("version", "errors", "buffers", "metrics", "progress", "concurrency", "observe"),
    ("kvtier", "keys", "auth", "configfields", "routing"),
    ("codec",),
    ("tiers",),
    ("config",),
    ("argtypes", "engine"),
    ("integrations", "admin"),
    ("bench", "serve"),
    ("plan",),
    ("check",),
    ("cli",),
)


def node_of(module: str) -> str:
    """The package-level node of a module: ``kvtier.tiers.dir.files`` ->
    ``kvtier.tiers``; ``kvtier`` -> ``kvtier``."""
    return ".".join(module.split(".")[:2])


def package_graph(package_dir: Path) -> dict[str, set[str]]:
    """Node -> the other nodes its modules import."""
    graph: dict[str, set[str]] = {}
    for module, imported in module_graph(package_dir).items():
        edges = graph.setdefault(node_of(module), set())
        edges.update(node_of(m) for m in imported)
    for node, edges in graph.items():
        edges.discard(node)
    return graph


def shown(graph: dict[str, set[str]]) -> str:
    short = lambda n: n.partition(".")[2] or n  # noqa: E731
    return "\n".join(f"    {short(n):<13} -> {', '.join(sorted(map(short, graph[n])))}"
                     for n in sorted(graph) if graph[n])


def test_kvtiers_packages_import_each_other_without_a_cycle():
    graph = package_graph(ROOT)
    assert {"kvtier.tiers", "kvtier.engine", "kvtier.concurrency", "kvtier.admin"} <= set(graph), \
        "the walk did not find kvtier's packages"
    found = cycles(graph)
    assert not found, ("packages that import each other (directly or around a loop): "
                       + "; ".join(" <-> ".join(c) for c in found) + "\nthe edges:\n" + shown(graph))


def test_every_package_import_goes_down_a_layer():
    graph = package_graph(ROOT)
    layer = {f"kvtier.{n}" if n != "kvtier" else n: i for i, names in enumerate(LAYERS) for n in names}
    unplaced = sorted(set(graph) - set(layer))
    assert not unplaced, f"give these a layer in LAYERS (and the docstring): {unplaced}"
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if layer[b] >= layer[a])
    assert not upward, ("imports that do not go down a layer: " + "; ".join(upward)
                        + "\nthe edges:\n" + shown(graph))


def test_the_package_graph_joins_submodules_and_sees_a_cycle_between_packages(tmp_path):
    """The package graph on a small package of real files: two packages
    whose submodules import each other (one inside a function) form a cycle;
    a root module imported by a package is a node of its own."""
    pkg = tmp_path / "pkg"
    for d in ("low/deep", "high"):
        (pkg / d).mkdir(parents=True)
    for f, text in {
        "__init__.py": "",
        "util.py": "",
        "low/__init__.py": "",
        "low/deep/__init__.py": "",
        "low/deep/a.py": "import pkg.util\n\ndef f():\n    from pkg.high import b\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low.deep import a\n",
    }.items():
        (pkg / f).write_text(text)
    graph = package_graph(pkg)
    assert graph == {"pkg": set(), "pkg.util": set(), "pkg.low": {"pkg.util", "pkg.high"}, "pkg.high": {"pkg.low"}}
    assert cycles(graph) == [["pkg.high", "pkg.low"]]
