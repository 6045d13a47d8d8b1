"""A stage that exits 2 (invalid configuration) before it ever served is not restarted: the supervisor
records that stage's last log line and stops, and `keel up` stops the mesh at once and prints it.
The supervisor tests run small Python children in place of the stages; the last ones run `keel up`
(in the foreground and with --detach) and the tests' and benches' mesh helper (testing/mesh.py)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from keelctl import supervisor
from keelctl.layout import Layout
from keelctl.supervisor import Child, Supervisor, last_line
from testing.mesh import ROOT, mesh_env, start_mesh

REASON = {"level": "ERROR", "msg": "invalid configuration; not starting",
          "error": "field 'replay.retention_days' breaks rule 'minimum'"}


@pytest.fixture
def sup(tmp_path, monkeypatch):
    """A supervisor of no stages (children are added by the test) whose state stays in memory."""
    monkeypatch.setattr(supervisor, "write_state", lambda state: None)
    s = Supervisor(Layout(), redis=False)
    yield s
    s.stop(grace_s=5)


def add_child(sup: Supervisor, tmp_path, code: str) -> Child:
    c = Child("stage-0.0", [sys.executable, "-c", code], {}, 0, "stage", log_path=tmp_path / "stage-0.0.log")
    sup.children.append(c)
    return c


def exits(status: int, line: str) -> str:
    """A child that writes ``line`` to stderr (its log) and exits with ``status``."""
    return f"import sys; print({line!r}, file=sys.stderr); sys.exit({status})"


def test_a_stage_exiting_2_before_serving_is_not_restarted_and_stops_the_supervisor(sup, tmp_path):
    c = add_child(sup, tmp_path, "print('loading', flush=True); " + exits(2, json.dumps(REASON)))
    sup.start()
    stop = threading.Event()
    runner = threading.Thread(target=sup.run, args=(stop,))
    runner.start()
    runner.join(30)
    stop.set()
    assert not runner.is_alive(), "run() did not return on the failed stage"
    assert sup.failed == ("stage-0.0 exited 2 before serving: invalid configuration; not starting: "
                          "field 'replay.retention_days' breaks rule 'minimum'")
    assert c.restarts == 0 and c.restart_at is None


def test_a_stage_exiting_1_before_serving_is_restarted(sup, tmp_path):
    c = add_child(sup, tmp_path, exits(1, "Traceback: boom"))
    sup.start()
    deadline = time.monotonic() + 30
    while c.restarts == 0 and time.monotonic() < deadline:
        sup.poll_once()
        time.sleep(0.05)
    assert c.restarts == 1 and sup.failed is None


def test_last_line_reads_a_json_record_as_its_message_and_error(tmp_path):
    log = tmp_path / "x.log"
    assert last_line(log) == ""
    log.write_text("plain start-up noise\n" + json.dumps(REASON) + "\n\n")
    assert last_line(log) == "invalid configuration; not starting: field 'replay.retention_days' breaks rule 'minimum'"
    log.write_text(json.dumps({"msg": "stopped"}) + "\nModuleNotFoundError: No module named 'x'\n")
    assert last_line(log) == "ModuleNotFoundError: No module named 'x'"


@pytest.mark.slow
@pytest.mark.parametrize("detach", [[], ["--detach"]])
def test_keel_up_stops_at_once_with_the_reason_of_a_stage_given_a_bad_config(tmp_path, detach):
    env = mesh_env(tmp_path, tokenizer_workers=1, extra_env={"KEEL_FEEDBACK_REPLAY__RETENTION_DAYS": "0"})[3]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "keelctl", "up", *detach], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    failed = [line for line in out.stdout.splitlines() if line.startswith("keel up failed: ")]
    assert failed and failed[0].startswith("keel up failed: feedback-0.0 exited 2 before serving: "
                                           "invalid configuration; not starting: "), out.stdout[-3000:]
    assert "replay.retention_days" in failed[0]
    assert time.monotonic() - t0 < 120  # not the layout's ready_timeout_s (300 s)


@pytest.mark.slow
def test_the_mesh_helper_raises_at_once_with_the_reason(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="^mesh did not come up: keel up failed: feedback-0.0 exited 2 before "
                                             "serving: invalid configuration; not starting: .*replay.retention_days"):
        start_mesh(tmp_path, tokenizer_workers=1, extra_env={"KEEL_FEEDBACK_REPLAY__RETENTION_DAYS": "0"})
    assert time.monotonic() - t0 < 120  # not Mesh.wait_serving's 240 s
