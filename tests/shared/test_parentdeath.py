"""shared/parentdeath.py: a process that armed SIGKILL dies with its parent, even while stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from shared.config import ROOT_DIR

# The parent starts the child (which arms SIGKILL, says so, then stops itself), prints its pid, and sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "armed\\n"
print(child.pid, flush=True)
time.sleep(600)
"""
CHILD = """
import os, signal
from shared import parentdeath
assert parentdeath.arm(signal.SIGKILL, os.getppid())
print("armed", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _gone(pid: int, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def _python(*args: str) -> list[str]:
    return [sys.executable, "-c", *args]


ENV = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}


def test_a_stopped_child_dies_when_its_parent_is_killed():
    parent = subprocess.Popen(_python(PARENT, CHILD), stdout=subprocess.PIPE, text=True, cwd=ROOT_DIR, env=ENV)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        for _ in range(100):
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                break
            time.sleep(0.05)
        assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(pid, 10), psutil.Process(pid).status()
    finally:
        parent.kill()
        parent.wait()
        if pid is not None and psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_parent_already_gone_is_told():
    armed = subprocess.run(_python("import os, signal; from shared import parentdeath; "
                                   "print(parentdeath.arm(signal.SIGKILL, os.getppid()), "
                                   "parentdeath.arm(signal.SIGKILL, os.getppid() + 1_000_000))"),
                           capture_output=True, text=True, cwd=ROOT_DIR, env=ENV, check=True)
    assert armed.stdout.split() == ["True", "False"]
