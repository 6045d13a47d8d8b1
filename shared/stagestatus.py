"""What a stage process is doing, told over keel.stage.v1.StageStatus (protos/keel/stage/v1/stage.proto).

Every stage serves it (shared/server.py registers it beside grpc.health.v1). The process has one
`StatusBoard`, `BOARD`: the server moves it through "starting", "warming up", "serving" and
"draining", and a stage's own start-up code reports its steps in between (the inference stage:
"starting the engine", "gating int8, bfloat16" with a count, "checking adapters"). Any thread may
report; the servicer reads a consistent snapshot. `describe` renders one status as the line
`keel up` and `keel status` print: "gating int8 120/200, about 40 s left".

Like health, the RPC answers before SERVING and without the mesh token (shared/interceptor.py
exempts it): what it tells is a phase name, counts and times, nothing a request carries.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from keel.stage.v1 import stage_pb2, stage_pb2_grpc

SERVICE = "keel.stage.v1.StageStatus"
# Until this share of a phase is done, its pace says too little for an estimate of what is left.
MIN_DONE_FOR_ETA = 0.02


@dataclass(frozen=True)
class Status:
    phase: str
    done: int = 0
    total: int = 0
    eta_s: float = 0.0
    phase_s: float = 0.0
    uptime_s: float = 0.0
    last_step: str = ""


class StatusBoard:
    """The process's current phase; `clock` is a monotonic clock in seconds."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._born = self._since = clock()
        self._phase, self._done, self._total, self._last = "starting", 0, 0, ""

    def phase(self, name: str, total: int = 0) -> None:
        """A new phase begins; `total`: how many items it has (0: no count)."""
        with self._lock:
            self._phase, self._done, self._total, self._since = name, 0, total, self._clock()

    def advance(self, done: int) -> None:
        """`done` items of the current phase are finished."""
        with self._lock:
            self._done = done

    def step_done(self, name: str, seconds: float, resume: str) -> None:
        """A named start-up step finished (shown beside the phase until the next one); the phase
        `resume` (the step's enclosing one) goes on, whatever sub-phase the step had reported."""
        with self._lock:
            self._last = f"{name} {seconds:.1f} s"
            if self._phase != resume:
                self._phase, self._done, self._total, self._since = resume, 0, 0, self._clock()

    def snapshot(self) -> Status:
        with self._lock:
            now = self._clock()
            phase_s = now - self._since
            eta = 0.0
            if self._total and self._done >= max(1, MIN_DONE_FOR_ETA * self._total):
                eta = phase_s * (self._total - self._done) / self._done
            return Status(self._phase, self._done, self._total, eta, phase_s, now - self._born, self._last)


BOARD = StatusBoard()  # the one board of this process


def describe(s: Status) -> str:
    """One line: "gating int8 120/200, about 40 s left (load_reference 2.0 s)"."""
    text = s.phase
    if s.total:
        text += f" {s.done}/{s.total}"
        if s.eta_s:
            text += f", about {_duration(s.eta_s)} left"
    elif s.phase not in ("serving", "draining") and s.phase_s >= 1:
        text += f", {_duration(s.phase_s)} so far"
    return text + (f" (done: {s.last_step})" if s.last_step and s.phase != "serving" else "")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60:02d} s"


def from_proto(msg) -> Status:
    return Status(msg.phase, msg.done, msg.total, msg.eta_s, msg.phase_s, msg.uptime_s, msg.last_step)


class StatusServicer(stage_pb2_grpc.StageStatusServicer):
    """keel.stage.v1.StageStatus over a board (grpc.aio)."""

    def __init__(self, board: StatusBoard = BOARD):
        self.board = board

    async def GetStatus(self, request, context):
        s = self.board.snapshot()
        return stage_pb2.GetStatusResponse(phase=s.phase, done=s.done, total=s.total, eta_s=s.eta_s,
                                           phase_s=s.phase_s, uptime_s=s.uptime_s, last_step=s.last_step)

    def register(self, server) -> None:
        stage_pb2_grpc.add_StageStatusServicer_to_server(self, server)
