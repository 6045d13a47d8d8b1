"""The processes of one run directory and the ports a mesh needs: who holds what, and stopping them.

Every process the supervisor starts carries ``KEEL_RUN_DIR`` (the absolute run directory) in its
environment, so the processes of a mesh can be found from /proc even when its supervisor is gone.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

RUN_DIR_ENV = "KEEL_RUN_DIR"


@dataclass(frozen=True)
class Holder:
    port: int
    what: str          # e.g. "gateway-0.0" or "redis"
    pid: int | None    # None: the owner is not visible (another user's process)
    command: str


def describe(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:160]
    except psutil.Error:
        return "?"


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_supervisor(pid: int | None) -> bool:
    """``pid`` is a live `keel up` supervisor (not a process that reused a dead one's pid)."""
    try:
        cmd = psutil.Process(pid).cmdline() if pid else []
    except psutil.Error:
        return False
    return alive(pid) and "keelctl" in cmd and "up" in cmd


def run_dir_processes(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for ``run_dir`` (not this process)."""
    want, me, found = str(run_dir.resolve()), os.getpid(), []
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and proc.environ().get(RUN_DIR_ENV) == want and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def stop(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM (a stage drains), then SIGKILL whatever is still there after ``grace_s``."""
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    left = _wait_gone(procs, grace_s)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(left, 5.0)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive after up to ``timeout_s`` (a zombie counts as gone: it serves nothing)."""
    deadline = time.monotonic() + timeout_s
    left = procs
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p.pid)]
    return left


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port`` (SO_REUSEADDR: connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def listener_pid(port: int) -> int | None:
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def held_ports(ports: dict[int, str], host: str = "127.0.0.1") -> list[Holder]:
    """The ports of ``ports`` (port -> what needs it) that something already listens on."""
    held = []
    for port, what in sorted(ports.items()):
        if port and port_in_use(host, port):
            pid = listener_pid(port)
            held.append(Holder(port, what, pid, describe(pid) if pid else "?"))
    return held
