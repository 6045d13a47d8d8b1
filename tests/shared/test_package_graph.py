"""The inference stage's subpackages import each other one way only: every import between two of
them follows an arrow of ALLOWED, so `model/` (the forward pass) can be read, tested and changed
without the engine, the adapters or the format machinery above it. test_import_graph.py checks that
modules form no loop; this checks the direction between packages, which a module graph cannot see."""
from __future__ import annotations

import ast
from pathlib import Path

from shared.config import ROOT_DIR

PACKAGE = "services.inference"
ROOT = "(root)"  # the stage's assembly at the package root: server, servicer, config, bootstrap, warmcache

# Who may import whom; anything else between these parts fails the test.
ALLOWED = {
    ROOT: {"engine", "formats", "lora", "model"},
    "formats": {"engine", "model"},  # format selection, the quality gate and the background gate
    "engine": {"lora", "model"},     # requests, scheduling, steps
    "lora": {"model"},               # adapters: registry, checks, weights
    "model": set(),                  # the architecture, weight formats, the forward pass
}


def part(module: str) -> str | None:
    """The subpackage of `module` (or ROOT), None for a module outside the inference package."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    rest = module[len(PACKAGE) + 1:].split(".")[0]
    return rest if rest in ALLOWED else ROOT


def imports(path: Path) -> set[str]:
    """Every module a file names in an import, wherever it sits (function bodies and type-only blocks too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def arrows() -> dict[tuple[str, str], list[str]]:
    """(from part, to part) -> the files that draw that arrow."""
    base = ROOT_DIR / PACKAGE.replace(".", "/")
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT_DIR).with_suffix("").parts
        src = part(".".join(parts))
        for name in imports(path):
            dst = part(name)
            if dst is not None and dst != src:
                found.setdefault((src, dst), []).append(str(path.relative_to(ROOT_DIR)))
    return found


def test_every_subpackage_of_inference_is_listed():
    base = ROOT_DIR / PACKAGE.replace(".", "/")
    folders = {p.parent.name for p in base.glob("*/__init__.py")}
    assert folders == set(ALLOWED) - {ROOT}


def test_the_inference_subpackages_import_each_other_one_way():
    bad = {f"{a} -> {b}": files for (a, b), files in arrows().items() if b not in ALLOWED[a]}
    assert not bad, f"imports against the allowed arrows of {__name__}.ALLOWED: {bad}"


def test_a_forbidden_arrow_is_seen(tmp_path):
    """The checker itself: a model module importing the engine is an arrow it reports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from services.inference.engine.core import Engine\n")
    assert {part(m) for m in imports(f)} == {"engine"} and "engine" not in ALLOWED["model"]
