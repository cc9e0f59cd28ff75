"""No import cycle among infer's modules, counting imports inside functions: a lazy import
hides a cycle from the interpreter, it does not remove it (the layering is in
docs and issue 36: args and distributed below the per-rank code, the engine above)."""

from __future__ import annotations

import ast
from pathlib import Path

import infer

ROOT = Path(infer.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(module: str, path: Path, node: ast.AST, known: dict) -> list[str]:
    """The infer modules an import statement names (a `from X import name` names X.name if
    that is a module, else X)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            anchor = package[:len(package) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_targets(module, path, node, known))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_sees_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a function-level import counts: the engine's lazy imports are edges too
    g = import_graph()
    assert "infer.core.executor.rank" in g["infer.core.speculative"]  # imported inside DraftModelProposer


def test_infer_has_no_import_cycle():
    graph = import_graph()
    assert cycles(graph) == [], {m: sorted(graph[m]) for c in cycles(graph) for m in c}
