"""Keel's own modules import each other without loops: the graph of every `import` in services/,
shared/ and keelctl/ (module level or inside functions; only `if TYPE_CHECKING:` blocks are left
out, since they never run) has no cycle. A package counts as its __init__ module, and importing
`a.b.c` also imports the packages `a` and `a.b`."""
from __future__ import annotations

import ast
from pathlib import Path

from shared.config import ROOT_DIR

PACKAGES = ("services", "shared", "keelctl")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, modules: set[str]) -> set[str]:
    """Keel modules a module's code imports (a `from pkg import name` of a submodule counts the submodule)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    closed = set()
    for name in out:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parts = name.split(".")
        closed |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return closed & modules


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT_DIR / pkg).rglob("*.py") if "migrations" not in p.parts]
    modules = {module_name(p) for p in files}
    return {module_name(p): imported(ast.parse(p.read_text(encoding="utf-8")), modules) - {module_name(p)}
            for p in files}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_loop_and_only_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def test_production_never_imports_the_tests():
    """Test hooks (fault injection, fixtures) live under tests/, what tests and benches share under
    testing/: no module of services/, shared/ or keelctl/ imports from either."""
    offenders = {}
    for pkg in PACKAGES:
        for path in (ROOT_DIR / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            bad = [n for n in names if n.split(".")[0] in ("tests", "testing")]
            if bad:
                offenders[module_name(path)] = bad
    assert offenders == {}


def test_keel_has_no_import_loops():
    edges = graph()
    assert "services.inference.engine.core" in edges and edges["services.inference.engine.core"]
    assert cycles(edges) == []
