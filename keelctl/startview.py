"""What `keel up` shows while the mesh starts and `keel status` afterwards: one line per process, its
health and what it says it is doing (keel.stage.v1.StageStatus, shared/stagestatus.py).

On a terminal the lines are redrawn in place; anywhere else (a pipe, a log file, CI) a line is
printed when a process's state changes: a new phase, or another tenth of a counted phase. Log
records meant for the person at the terminal go through the same view (`LogHandler`), so they
never tear the redrawn block.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TextIO

import grpc

from keel.stage.v1 import stage_pb2, stage_pb2_grpc
from shared import stagestatus, tls
from shared.logging import ReadableFormatter

REFRESH_S = 0.5  # how often the stage statuses are asked for and shown


def stage_status(target: str, timeout_s: float = 1.0) -> stagestatus.Status | None:
    """What the process at `target` says it is doing; None when it does not answer."""
    try:
        with tls.sync_channel(target) as ch:
            resp = stage_pb2_grpc.StageStatusStub(ch).GetStatus(stage_pb2.GetStatusRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return stagestatus.from_proto(resp)


def row(health: str, status: stagestatus.Status | None, width: int = 12) -> str:
    """The state column: health (padded to `width`), then the phase line unless the phase is plain
    "serving" (a serving process may report work of its own, e.g. a gate run in the background)."""
    if status is None or status.phase == "serving":
        return health
    return f"{health:<{width}} {stagestatus.describe(status)}"


def _change_key(status: stagestatus.Status | None, health: str) -> tuple:
    """What counts as a change worth a plain line: health, phase, and tenths of a counted phase."""
    if status is None:
        return (health,)
    return (health, status.phase, status.done * 10 // status.total if status.total else 0)


class StartView:
    """The per-process lines of a starting mesh on `out` (a terminal: in place)."""

    def __init__(self, targets: dict[str, tuple[str, str]], out: TextIO = sys.stdout, tty: bool | None = None):
        self.targets = targets
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._drawn = 0           # lines of the block on screen (terminal)
        self._lines: list[str] = []
        self._seen: dict[str, tuple] = {}
        self._last_draw = 0.0

    def update(self, health: dict[str, str]) -> None:
        """One poll's health of every process (name -> SERVING/NOT_SERVING/DOWN/...); the stage
        status is asked of those not yet serving."""
        now = time.monotonic()
        if now - self._last_draw < REFRESH_S and not all(v == "SERVING" for v in health.values()):
            return  # the statuses are asked at most every REFRESH_S, the final one always
        self._last_draw = now
        lines, changed = [], []
        for name, st in health.items():
            status = None if st == "SERVING" else stage_status(self.targets[name][0])
            lines.append(f"  {name:<28} {row(st, status)}")
            key = _change_key(status, st)
            if self._seen.get(name) != key:
                self._seen[name] = key
                changed.append(f"{name} {row(st, status, 0)}")
        with self._lock:
            self._lines = lines
            if self.tty:
                self._redraw()
            else:
                for line in changed:
                    self.out.write(line + "\n")
                self.out.flush()

    def message(self, text: str) -> None:
        """A line for the person at the terminal (a log record), printed above the block."""
        with self._lock:
            if self.tty and self._drawn:
                self.out.write(f"\x1b[{self._drawn}F\x1b[J")
                self._drawn = 0
            self.out.write(text + "\n")
            if self.tty:
                self._redraw()
            self.out.flush()

    def finish(self) -> None:
        """Take the redrawn block off the screen (what follows replaces it); plain lines stay."""
        with self._lock:
            if self.tty and self._drawn:
                self.out.write(f"\x1b[{self._drawn}F\x1b[J")
                self.out.flush()
            self._drawn = 0
            self._lines = []

    def _redraw(self) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F")  # to the block's first line
        try:  # a line wider than the terminal would wrap, and the block's height be miscounted
            width = os.get_terminal_size(self.out.fileno()).columns - 1
        except (OSError, ValueError, AttributeError):
            width = 0
        for line in self._lines:
            self.out.write("\x1b[2K" + (line[:width] if width > 0 else line) + "\n")
        self.out.write("\x1b[J")
        self._drawn = len(self._lines)
        self.out.flush()


class LogHandler(logging.Handler):
    """Records at WARNING and above, one readable line each (shared/logging.py ReadableFormatter),
    printed through the view so they land above its block."""

    def __init__(self, view: StartView):
        super().__init__(logging.WARNING)
        self.view = view
        self.setFormatter(ReadableFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.view.message(self.format(record))
        except Exception:  # a broken terminal must not break the supervisor
            self.handleError(record)
