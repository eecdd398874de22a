"""The package's import graph, read from the source (no import runs, no PyTorch): no module imports
one that imports it back, at module level or inside a function, and the runtime never imports the
config reader (it takes specs, not files)."""
from __future__ import annotations

import ast
from pathlib import Path

import tensorstep

ROOT = Path(tensorstep.__file__).parent
SKIP = {"tests", "generated", "build", "examples", "docs", "__pycache__"}


def _module(path: Path) -> str:
    parts = ("tensorstep", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, dict[str, int]]:
    """module → {tensorstep module it imports: line}, for every import statement anywhere in it."""
    files = {_module(p): p for p in ROOT.rglob("*.py")
             if not SKIP & set(p.relative_to(ROOT).parts) and not p.relative_to(ROOT).parts[0].startswith(".")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{alias.name}" for alias in node.names]  # `from . import x`
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for target in names:
                if target in files and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_module_and_function_level_imports():
    graph = _graph()
    assert "tensorstep.runtime.registry" in graph["tensorstep.runtime.ops"]  # from .registry import ...
    assert "tensorstep.runtime.ops" in graph["tensorstep.runtime.api"]  # from . import ops, in a function
    assert "tensorstep.config" in graph["tensorstep.cli"]  # from .config import ..., in a function
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = _graph()
    described = [" ; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in cycle for b in graph[a] if b in cycle)
                 for cycle in _cycles(graph)]
    assert not described, described


def test_the_runtime_does_not_import_the_config_reader():
    graph = _graph()
    runtime = [m for m in graph if m.startswith("tensorstep.runtime.")]
    assert len(runtime) > 5
    offending = [f"{m} (line {graph[m]['tensorstep.config']})" for m in runtime if "tensorstep.config" in graph[m]]
    assert not offending, offending
