"""kill -9 of the supervisor: every stage and Redis die with it (parent-death signal), nothing keeps
listening, and `keel status` does not report the dead mesh as healthy."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from keelctl import procs
from keelctl.layout import load_layout
from keelctl.supervisor import layout_ports
from testing.mesh import ROOT, start_mesh, stop_mesh, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_children_die_with_a_killed_supervisor(tmp_path):
    mesh = start_mesh(tmp_path, tokenizer_workers=1)
    try:
        pids = [p["pid"] for p in mesh.state()["processes"].values()]
        # Redis and one process per stage (validator, tokenizer, inference, feedback, gateway, openai)
        assert len(pids) == 7 and all(procs.alive(p) for p in pids)
        os.kill(mesh.proc.pid, signal.SIGKILL)
        mesh.proc.wait()
        wait_until(lambda: not any(procs.alive(p) for p in pids), 60, "every child of the killed supervisor to exit")
        env = dict(os.environ, KEEL_KEEL_CONFIG=str(tmp_path / "keel.json"), KEEL_VAR_DIR=str(tmp_path / "var"))
        # A process whose main thread has exited shows as a zombie while its other threads (torch's,
        # grpc's) still tear down its memory; its sockets close when the last one is gone.
        ports = layout_ports(load_layout(tmp_path / "keel.json"))
        wait_until(lambda: not procs.held_ports(ports), 60, "every port of the dead mesh to be released")
        out = subprocess.run([sys.executable, "-m", "keelctl", "status"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "keel is not running" in out.stdout, out.stdout
    finally:
        stop_mesh(mesh)
