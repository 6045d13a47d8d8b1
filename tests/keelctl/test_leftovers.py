"""`keel up`, `keel down` and `keel status` against what a previous mesh left behind: a port held by
another process, processes of the run directory whose supervisor is gone, health answered by a mesh
nobody supervises. Real processes and sockets; no mesh is started."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keelctl.procs import RUN_DIR_ENV
from testing.mesh import ROOT, mesh_env
from tests.e2e.conftest import SERVICES


def keel(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keelctl", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def layout(tmp_path):
    return mesh_env(tmp_path, tokenizer_workers=1)


def test_up_refuses_a_held_port_and_names_the_pid(tmp_path, layout):
    _, ports, _, env = layout
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports["gateway"][0]))
        s.listen()
        out = keel(env, "up")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"port {ports['gateway'][0]} (gateway-0) is held by pid {os.getpid()}" in out.stdout
    assert not (tmp_path / "var" / "log" / "gateway-0.0.log").exists()  # nothing was started


def orphan(tmp_path: Path, env: dict) -> subprocess.Popen:
    """A process of the run directory whose supervisor is dead (the state names a finished pid)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "var" / "run"
    run.mkdir(parents=True)
    (run / "keel.json").write_text(json.dumps({"pid": dead.pid, "processes": {}}))
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env=dict(env, **{RUN_DIR_ENV: str(run.resolve())}))


def test_down_stops_processes_of_the_run_directory_without_a_supervisor(tmp_path, layout):
    env = layout[3]
    left = orphan(tmp_path, env)
    try:
        out = keel(env, "down")
        assert out.returncode == 0 and f"pid {left.pid}" in out.stdout, out.stdout
        assert left.wait(10) is not None
    finally:
        left.kill()


def test_status_does_not_call_an_unsupervised_mesh_healthy(tmp_path, layout):
    _, ports, _, env = layout
    left = orphan(tmp_path, env)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for stage, stage_ports in ports.items():
        if stage in SERVICES:  # an HTTP stage's port is simply held here
            servicer.set(SERVICES[stage], health_pb2.HealthCheckResponse.SERVING)
        for p in stage_ports:
            server.add_insecure_port(f"127.0.0.1:{p}")
    server.start()
    try:
        out = keel(env, "status")
    finally:
        server.stop(None)
        left.kill()
    assert out.returncode == 1, out.stdout
    assert "keel is not running" in out.stdout and "SERVING" not in out.stdout
    assert f"pid {left.pid}" in out.stdout
    assert f"port {ports['gateway'][0]} (gateway-0) is held by pid {os.getpid()}" in out.stdout
