"""Progress of long CLI steps (shared/progress.py): a tqdm bar on a terminal (a pty here), plain
lines off it; and `keel etl run`, one of the commands that use it, both ways."""
from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from services.feedback.store import open_store
from shared import progress
from shared.progress import Progress
from tests.feedback.test_etl import fill

ROOT = Path(__file__).resolve().parents[2]


def open_pty() -> tuple[int, int]:
    """A pty pair whose terminal is 100 columns wide (a fresh pty says 0, and a bar fits in nothing)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    return master, slave


def read_all(fd: int, until=lambda: False, timeout_s: float = 120) -> str:
    """What a pty's master side received until `until()` holds and nothing more arrives."""
    out, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the slave side is closed
                break
            if not chunk:
                break
            out += chunk
        elif until():
            break
    return out.decode(errors="replace")


def test_off_a_terminal_a_counted_step_prints_a_line_per_tenth():
    err, out = io.StringIO(), io.StringIO()
    with Progress("probe runs", 48, out=err, unit="step") as bar:
        for i in range(48):
            bar.update()
            if i == 23:
                bar.write("a result line", out=out)
    lines = err.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "probe runs: 0/48 (0%)", "probe runs: 5/48 (10%)", "probe runs: 10/48 (20%)", "probe runs: 15/48 (31%)",
        "probe runs: 20/48 (41%)", "probe runs: 24/48 (50%)", "probe runs: 29/48 (60%)", "probe runs: 34/48 (70%)",
        "probe runs: 39/48 (81%)", "probe runs: 44/48 (91%)", "probe runs: 48/48 (100%)",
        "probe runs: 48/48 (100%) done"]
    assert "\r" not in err.getvalue() and out.getvalue() == "a result line\n"


def test_off_a_terminal_an_uncounted_step_prints_every_thousand(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY", 10)
    err = io.StringIO()
    with Progress("rows read", out=err) as bar:
        for _ in range(25):
            bar.update()
    assert [line.split(",")[0] for line in err.getvalue().splitlines()] == [
        "rows read: 0", "rows read: 10", "rows read: 20", "rows read: 25 done"]


def test_on_a_terminal_it_is_a_tqdm_bar_with_lines_above_it():
    master, slave = open_pty()
    with os.fdopen(slave, "w") as tty:
        with Progress("replaying", 3, out=tty, unit="request") as bar:
            assert bar.tty
            bar.update()
            bar.write("trace-1  identical", out=tty)
            bar.update(2)
    shown = read_all(master, until=lambda: True)
    assert "replaying" in shown and "3/3" in shown and "request" in shown and "\r" in shown
    assert "trace-1  identical" in shown and "(100%)" not in shown  # a bar, not the plain lines


def test_a_terminal_that_reports_no_size_still_gets_a_bar():
    master, slave = pty.openpty()  # 0 columns
    with os.fdopen(slave, "w") as tty:
        with Progress("replaying", 2, out=tty) as bar:
            bar.update(2)
    assert "replaying: 100%" in read_all(master, until=lambda: True)


def _etl(tmp_path, *, tty: bool) -> tuple[int, str, str]:
    env = dict(os.environ, KEEL_FEEDBACK_DATABASE__URL=f"sqlite:///{tmp_path / 'f.db'}",
               KEEL_VAR_DIR=str(tmp_path / "var"), COLUMNS="100")
    argv = [sys.executable, "-m", "keelctl", "etl", "run", "--since", "24h", "--out", str(tmp_path / "out")]
    if not tty:
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        return out.returncode, out.stdout, out.stderr
    master, slave = open_pty()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    shown = read_all(master, until=lambda: proc.poll() is not None)
    os.close(master)
    return proc.wait(60), shown, shown


@pytest.mark.slow
def test_keel_etl_run_shows_a_bar_on_a_terminal_and_plain_lines_off_it(tmp_path):
    fill(open_store(f"sqlite:///{tmp_path / 'f.db'}"), 12)
    rc, stdout, stderr = _etl(tmp_path, tty=False)
    assert rc == 0, stdout + stderr
    assert "dataset " in stdout and "etl: feedback rows read" not in stdout
    assert [line.split(",")[0] for line in stderr.splitlines()] == ["etl: feedback rows read: 0",
                                                                    "etl: feedback rows read: 12 done"]
    rc, shown, _ = _etl(tmp_path, tty=True)
    assert rc == 0, shown
    assert "etl: feedback rows read: 12" in shown and "row/s" in shown and "\r" in shown and " done," not in shown
