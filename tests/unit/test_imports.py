"""No import cycle between the modules of ``pglock``.

The graph is read from the source (AST), not from ``sys.modules``: every ``import`` and
``from ... import`` statement counts, at module level and inside functions, and so do the
imports under ``if TYPE_CHECKING:`` (a cycle there is still a design knot, and mypy follows
it). ``importlib.import_module("pglock....")`` with a literal (or an f-string with a literal
prefix: every module under that prefix) counts too. A package stands for its ``__init__``;
``from . import x`` is an edge to the submodule ``x`` when there is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pglock

ROOT = Path(pglock.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("pglock", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[importer].name == "__init__.py"
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic(node: ast.Call) -> list[str]:
    """The pglock modules an ``importlib.import_module(...)`` call names."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "import_module" and node.args):
        return []
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return [m for m in MODULES if m.startswith(prefix)]
    return []


def _imports(name: str) -> set[str]:
    """The pglock modules that module ``name`` imports, anywhere in its source."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, node)
            subs = [f"{module}.{alias.name}" for alias in node.names]
            targets.update(s for s in subs if s in MODULES)
            if not all(s in MODULES for s in subs):
                targets.add(module)
        elif isinstance(node, ast.Call):
            targets.update(_dynamic(node))
    return {t for t in targets if t in MODULES and t != name}


def import_graph() -> dict[str, set[str]]:
    return {name: _imports(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on a cycle, deduplicated."""
    found: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        # Breadth-first from start's successors back to start: the shortest cycle through it.
        paths = {n: [start, n] for n in sorted(graph[start])}
        queue = list(paths)
        while queue and start not in paths:
            node = queue.pop(0)
            for nxt in sorted(graph[node]):
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    queue.append(nxt)
        if start in paths:
            cycle = paths[start]
            found.setdefault(frozenset(cycle), cycle)
    return list(found.values())


def test_the_graph_sees_imports_in_functions_and_type_checking_blocks() -> None:
    graph = import_graph()
    assert "pglock._pool" in graph["pglock"]
    assert "pglock._advisory" in graph["pglock._pool"]
    # Inside a function (install() imports the connect defaults only when it connects).
    assert "pglock._deadline" in graph["pglock._schema"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in pglock:\n" + "\n".join(" -> ".join(c) for c in found)


def test_pglock_imports_no_optional_framework() -> None:
    """``import pglock``, and telling apart objects that are none of them, loads neither Django
    nor SQLAlchemy: they are imported only once the caller passes one of their objects. Nor
    OpenTelemetry, imported only by ``configure_telemetry()``, whose hooks are not installed."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, pglock\n"
        "from pglock._classify import kind_of\n"
        "assert kind_of(object()) is None and kind_of('dbname=x') is not None\n"
        "assert not pglock._telemetry.installed()\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.split('.')[0] in ('django', 'sqlalchemy', 'opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT.parent)},  # this tree's pglock
    )
    assert done.returncode == 0, done.stderr
