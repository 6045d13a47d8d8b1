"""How the supervisor learns that a child is serving: sd_notify READY=1 on its socket, counted only
for the pid the kernel says sent it. Real processes: a Python child using shared.notify, and Redis
started the way the supervisor starts it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from keelctl.readiness import ReadySocket
from shared import notify
from testing.mesh import ROOT
from testing.ports import free_port


@pytest.fixture
def sock():
    s = ReadySocket()
    yield s
    s.close()


def child(code: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)


def collect(sock: ReadySocket, timeout_s: float) -> list[int]:
    """Every READY=1 sender seen within ``timeout_s`` (returns at the first one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = sock.ready_pids()
        if pids:
            return pids
        time.sleep(0.05)
    return []


def test_a_stage_process_that_reports_ready_is_known_by_its_pid(sock):
    p = child("from shared import notify; notify.ready()", dict(os.environ, **{notify.ENV: sock.name}))
    assert p.wait(60) == 0
    assert sock.ready_pids() == [p.pid]  # sendto has queued it before the child exited
    assert sock.ready_pids() == []       # each message is read once


def test_messages_without_ready_do_not_count(sock):
    code = ("import socket; from shared import notify; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); "
            f"s.sendto(b'STATUS=loading\\nREADY=0\\n', notify.address({sock.name!r}))")
    p = child(code, dict(os.environ))
    assert p.wait(60) == 0
    assert sock.ready_pids() == []


def test_without_a_notify_socket_ready_sends_nothing_and_does_not_fail(sock):
    env = {k: v for k, v in os.environ.items() if k != notify.ENV}
    p = child("from shared import notify; notify.ready()", env)
    assert p.wait(60) == 0
    assert sock.ready_pids() == []


def test_redis_supervised_by_systemd_protocol_reports_ready(sock, tmp_path):
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    redis = subprocess.Popen([server, "--port", str(free_port()), "--bind", "127.0.0.1", "--save", "",
                              "--dir", str(tmp_path), "--supervised", "systemd"],
                             env=dict(os.environ, **{notify.ENV: sock.name}), stdout=subprocess.DEVNULL)
    try:
        assert collect(sock, 30) == [redis.pid]
    finally:
        redis.kill()
        redis.wait()
