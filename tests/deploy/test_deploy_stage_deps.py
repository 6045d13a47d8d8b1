"""Per-stage dependency groups: the gateway, tokenizer, validator, feedback and openai images install the lock without
its 'inference-only' lines (the torch stack), so everything their code imports, and everything
that needs in turn, must be outside that group; only the inference image adds it."""
from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.deploy.dockerfiles import dockerfile, section, stages_of

ROOT = Path(__file__).resolve().parents[2]
LIGHT = ("gateway", "tokenizer", "validator", "feedback", "openai")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_groups() -> tuple[set[str], set[str]]:
    """(core pins an image installs, 'inference-only' pins) as normalised names."""
    core, heavy = set(), set()
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" not in line or line.startswith("#") or "# dev-only" in line or "# bench-only" in line:
            continue
        (heavy if "# inference-only" in line else core).add(_key(line.split("==")[0]))
    return core, heavy


def imported_modules(*dirs: str) -> set[str]:
    """Top-level modules imported anywhere (module level or inside functions) under ``dirs``."""
    tops = set()
    for d in dirs:
        for path in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    tops |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops.add(node.module.split(".")[0])
    return tops


def needed_distributions(modules: set[str]) -> set[str]:
    """The installed distributions providing ``modules``, with their transitive requirements."""
    by_module = metadata.packages_distributions()
    todo = [d for m in modules for d in by_module.get(m, [])]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if _key(name) in seen:
            continue
        seen.add(_key(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for raw in requires:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen - {"keel"}


@pytest.mark.parametrize("stage", LIGHT)
def test_light_stages_need_nothing_from_the_torch_group(stage):
    core, heavy = lock_groups()
    needed = needed_distributions(imported_modules(f"services/{stage}", "shared"))
    assert not needed & heavy, f"{stage} needs inference-only packages: {sorted(needed & heavy)}"
    assert needed <= core, f"{stage} needs packages missing from the lock: {sorted(needed - core)}"
    assert "torch" not in needed


def test_the_inference_stage_gets_the_torch_group():
    core, heavy = lock_groups()
    needed = needed_distributions(imported_modules("services/inference", "shared"))
    assert "torch" in needed and needed <= core | heavy
    assert {"torch", "transformers", "safetensors"} <= heavy


@pytest.mark.parametrize("stage", LIGHT + ("inference",))
def test_only_the_inference_image_installs_the_torch_group(stage):
    deps = next(s for s in stages_of(dockerfile()) if s["name"] == "deps")
    body = " ".join(args for _w, args in deps["body"])
    assert "-e '# inference-only'" in body and "torch" not in body  # the shared deps stage skips it
    venv_from = [args for w, args in section(stage) if w == "COPY" and args.endswith(" .venv")]
    assert venv_from == ["--from=torch /app/.venv .venv" if stage == "inference" else "--from=deps /app/.venv .venv"]
