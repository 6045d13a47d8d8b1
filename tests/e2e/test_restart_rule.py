"""The supervisor's restart rule against real processes under `keel up`: a child killed -9 while
serving is restarted after the initial backoff each time, up to ``restart.burst`` such deaths per
``stable_after_s``, then the wait doubles; a stage that cannot start (a bad config) is restarted
with a doubling wait, and once it serves again a kill brings it back at the initial wait."""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from testing.mesh import ROOT, start_mesh, stop_mesh, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BURST = 2
INITIAL_S = 0.2  # restart.initial_backoff_s of the test layout (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def rule_mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart-rule")
    cfg = tmp / "validator.yaml"
    shutil.copy(ROOT / "config" / "validator.yaml", cfg)
    m = start_mesh(tmp, tokenizer_workers=1, extra_env={
        "KEEL_VALIDATOR_CONFIG": str(cfg), "KEEL_KEEL_RESTART__BURST": str(BURST),
        # the longest window: every death of this module counts, however slow the machine is
        "KEEL_KEEL_RESTART__STABLE_AFTER_S": "3600"})
    m.validator_config = cfg
    yield m
    stop_mesh(m)


def exits(mesh, name: str) -> list[dict]:
    return [r for r in mesh.log("supervisor") if r.get("stage") == name and r["msg"] == "stage exited; restarting"]


def serving_pid(mesh, name: str) -> int | None:
    """The pid of ``name``'s current process once the supervisor has its READY=1, else None."""
    pid = mesh.state()["processes"][name]["pid"]
    ready = any(r.get("stage") == name and r["msg"] == "serving" and r.get("pid") == pid
                for r in mesh.log("supervisor"))
    return pid if ready else None


def kill_while_serving(mesh, name: str) -> dict:
    """kill -9 ``name`` once the supervisor knows it is serving; the supervisor's record of it
    (returned once the successor is started, so that the next call sees the new pid)."""
    pid = wait_until(lambda: serving_pid(mesh, name), 120, f"{name} serving")
    before = len(exits(mesh, name))
    os.kill(pid, signal.SIGKILL)
    record = wait_until(lambda: exits(mesh, name)[before:][:1], 30, f"the supervisor noticing {name}'s death")[0]
    wait_until(lambda: mesh.state()["processes"][name]["pid"] != pid, 60, f"{name} restarted")
    return record


@pytest.mark.parametrize("name", ["tokenizer-0.0", "redis"])
def test_kills_while_serving_restart_at_the_initial_backoff_until_the_burst(rule_mesh, name):
    records = [kill_while_serving(rule_mesh, name) for _ in range(BURST + 2)]
    assert all(r["served"] and r["signal"] == signal.SIGKILL for r in records), records
    assert [r["backoff_s"] for r in records] == [INITIAL_S, INITIAL_S, 2 * INITIAL_S, 4 * INITIAL_S]
    wait_until(lambda: serving_pid(rule_mesh, name), 120, f"{name} serving again")


def test_a_stage_that_cannot_start_backs_off_and_is_back_at_once_after_it_serves(rule_mesh):
    name, cfg = "validator-0.0", rule_mesh.validator_config
    good = cfg.read_text()
    cfg.write_text(good + "\nnot_a_setting: 1\n")  # the schema refuses it: the stage exits 2 at start
    first = kill_while_serving(rule_mesh, name)
    assert first["served"] and first["backoff_s"] == INITIAL_S
    before = len(exits(rule_mesh, name))
    loop = wait_until(lambda: exits(rule_mesh, name)[before:][:4] if len(exits(rule_mesh, name)) >= before + 4
                      else None, 120, "four failed starts")
    cfg.write_text(good)
    assert [(r["served"], r["exit_code"]) for r in loop] == [(False, 2)] * 4
    assert [r["backoff_s"] for r in loop] == [2 * INITIAL_S, 4 * INITIAL_S, 8 * INITIAL_S, 16 * INITIAL_S]
    again = kill_while_serving(rule_mesh, name)  # served again: its doubled wait is forgotten
    assert again["served"] and again["backoff_s"] == INITIAL_S
