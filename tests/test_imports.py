"""No import cycle in ``kvtier/``: the package's modules, read statically (ast),
form a graph without cycles.

What counts as an import of module B by module A:

- every ``import`` statement in A, at module level *and inside functions*: a
  lazy import defers loading, not dependency. Two modules that import each
  other, one of them inside a function, are still two modules a reader must
  understand together (``cli.py`` and ``plan/cli.py`` were such a pair), and
  the function-level import is only one refactoring away from an import-time
  failure. ``__import__``/``importlib.import_module`` of a literal name too;
  a name computed at run time (the tier registry's table) cannot be seen;
- ``import a.b.c`` imports ``a.b.c``; ``from a.b import c`` imports ``a.b.c``
  when that is a module, else ``a.b`` (a name defined in its ``__init__``);
  relative imports are resolved against A's package;
- the parent packages Python initialises on the way (``a`` and ``a.b`` for
  ``a.b.c``) are not edges: a package ``__init__`` that re-exports its
  submodules (``kvtier.bench.soak``) would otherwise form a cycle with each
  of them, while neither names the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).parent


def module_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (see the docstring)."""
    top = package_dir.name
    files: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        files[".".join(parts)] = (path, is_pkg)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in files.items():
        package = name if is_pkg else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not source.split(".")[0] == top:
                    continue
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    edges.add(sub if sub in files else source)
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and (getattr(node.func, "id", None) == "__import__" or getattr(node.func, "attr", None) == "import_module")
                  and node.args[0].value in files):
                edges.add(node.args[0].value)
        edges.discard(name)
        edges &= set(files)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan),
    each sorted; a module importing itself is not a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_kvtier_has_no_import_cycle():
    graph = module_graph(ROOT)
    assert len(graph) > 50 and graph["kvtier.cli"], "the walk did not find kvtier's modules and their imports"
    found = cycles(graph)
    assert not found, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_walk_sees_function_level_relative_and_from_package_imports(tmp_path):
    """The detector on a small package of real files: each kind of import it
    claims to see closes a cycle that it must report."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f, text in {
        "__init__.py": "",
        "a.py": "def f():\n    from pkg import b\n",  # function level
        "b.py": "from . import a\n",  # relative
        "c.py": "import pkg.sub.d\n",
        "sub/__init__.py": "from pkg.sub import d\n",  # a package re-exporting its module: no cycle
        "sub/d.py": "from pkg.sub.e import X\n",
        "sub/e.py": "X = 1\n\ndef g():\n    return __import__('pkg.c')\n",  # dynamic, literal
        "lone.py": "import os\nimport pkg.lone\n",  # itself and the standard library: nothing
    }.items():
        (pkg / f).write_text(text)
    graph = module_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.d"} and graph["pkg.lone"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d", "pkg.sub.e"]]
