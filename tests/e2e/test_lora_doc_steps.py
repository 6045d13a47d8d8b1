"""docs/lora.md's "first adapter on a fresh clone" block, run line by line on a fresh var/.

The `keel lora register` line runs before any stage has served (no base.json, so the golden outputs
are made in float32); the mesh then serves int8, as `engine.format: auto` does once its gate passes
int8, and the adapter must still answer: it is bound to the weights, and the drift gate checks the
format. `make adapters` is the cached fixture of tests/e2e/test_lora_mesh.py (training.adapters).

The walk is the session fixture lora_walk (tests/e2e/conftest.py), whose mesh also serves
tests/e2e/test_lora_mesh.py: that file's other adapters are registered just before `keel up`
(after the block's own registration, so it still runs before any stage has served), and refused
at start, so the pirate is still the one adapter accepted."""
from __future__ import annotations

import re
import shlex
import shutil

import pytest

from testing.mesh import ROOT, start_mesh, stop_mesh
from tests.e2e.test_cli import keel
from tests.e2e.test_lora_mesh import keel_lora
from training.adapters import DEFAULT_BASE, DEFAULT_OUT, make_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

SERVED_FORMAT = "int8"  # what auto serves after a passing gate on this host kind (docs/inference-formats.md)


def doc_steps() -> list[str]:
    """The command lines of the block under "## The first adapter on a fresh clone", comments cut."""
    text = (ROOT / "docs" / "lora.md").read_text()
    block = re.search(r"## The first adapter on a fresh clone\n+```\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_doc_block_is_what_this_test_runs():
    steps = doc_steps()
    assert [shlex.split(s)[:3] for s in steps] == [
        ["make", "adapters"], ["keel", "lora", "register"], ["keel", "up", "--detach"],
        ["keel", "ask", "What is the capital of France?"]]


def walk(tmp, before_up):
    """Each line of the block in order, ``before_up(tmp)`` just before `keel up`: yields the mesh,
    {line: completed process} and what ``before_up`` returned (tests/e2e/conftest.py's lora_walk)."""
    outputs, mesh, beside = {}, None, None
    try:
        for line in doc_steps():
            argv = shlex.split(line)
            if argv[:2] == ["make", "adapters"]:
                make_all(ROOT / DEFAULT_OUT, ROOT / DEFAULT_BASE)
            elif argv[:3] == ["keel", "lora", "register"]:
                assert not (tmp / "var" / "adapters" / "base.json").exists()  # no stage has served yet
                outputs[line] = keel_lora(tmp, *argv[2:])
            elif argv[:2] == ["keel", "up"]:  # the test's own free ports, waited on until SERVING
                beside = before_up(tmp)
                # int8 without a stored gate result (its gate is tested elsewhere): force it
                mesh = start_mesh(tmp, extra_env={"KEEL_INFERENCE_ENGINE__FORMAT": SERVED_FORMAT,
                                                  "KEEL_INFERENCE_FORMATS__FORCE": "true"})
            else:
                outputs[line] = keel(mesh, *argv[1:])
        yield mesh, outputs, beside
    finally:
        if mesh is not None:
            stop_mesh(mesh)
        shutil.rmtree(tmp / "var" / "adapters", ignore_errors=True)


def test_register_before_any_start_then_the_adapter_serves_in_another_format(lora_walk):
    mesh, outputs, _ = lora_walk
    register, ask = outputs.values()
    assert register.returncode == 0, register.stdout + register.stderr
    assert "golden outputs made in float32" in register.stdout
    # off a terminal, the check runs' progress is plain lines on stderr, the last one "... done"
    progress = [line for line in register.stderr.splitlines() if line.startswith("pirate@1: check runs: ")]
    assert progress and " done, " in progress[-1] and "\r" not in register.stderr
    assert ask.returncode == 0, ask.stdout + ask.stderr
    assert "adapter pirate@1" in ask.stdout and "Arr" in ask.stdout
    accepted = [r for r in mesh.log("inference-0.0") if r.get("msg") == "adapter accepted"]
    assert [(r["adapter"], r["golden_format"], r["serving_format"]) for r in accepted] == [
        ("pirate@1", "float32", SERVED_FORMAT)]
