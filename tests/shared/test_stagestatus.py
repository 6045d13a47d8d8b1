"""The stage status (shared/stagestatus.py): the board's phases, counts and estimate; its one-line
rendering; and the RPC every stage serves before SERVING, without credentials."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from keel.stage.v1 import stage_pb2, stage_pb2_grpc
from shared import stagestatus
from shared.interceptor import ServerInterceptor
from shared.stagestatus import Status, StatusBoard, describe


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_counted_phase_estimates_what_is_left_from_its_pace():
    clock = Clock()
    board = StatusBoard(clock)
    clock.now += 5
    board.phase("gating int8", total=200)
    assert board.snapshot().eta_s == 0  # nothing done yet: no estimate
    clock.now += 60
    board.advance(120)
    s = board.snapshot()
    assert (s.phase, s.done, s.total, s.phase_s, s.uptime_s) == ("gating int8", 120, 200, 60, 65)
    assert s.eta_s == pytest.approx(40)
    assert describe(s) == "gating int8 120/200, about 40 s left"


def test_a_finished_step_is_shown_and_its_enclosing_phase_resumes():
    clock = Clock()
    board = StatusBoard(clock)
    board.phase("starting the engine")
    board.phase("gating int8", total=10)
    board.advance(10)
    clock.now += 3
    board.step_done("quality_gate", 3.04, "starting the engine")
    s = board.snapshot()
    assert (s.phase, s.total, s.last_step) == ("starting the engine", 0, "quality_gate 3.0 s")
    clock.now += 2
    assert describe(board.snapshot()) == "starting the engine, 2 s so far (done: quality_gate 3.0 s)"


def test_long_estimates_read_in_minutes_and_serving_says_only_that():
    assert describe(Status("gating int8", 1, 200, eta_s=500)) == "gating int8 1/200, about 8 min 20 s left"
    assert describe(Status("serving", phase_s=30, last_step="adapters 1.0 s")) == "serving"


@pytest.mark.parametrize("ready", [False, True])
def test_the_rpc_answers_before_serving_and_without_the_mesh_token(ready):
    async def main():
        board = StatusBoard()
        board.phase("gating int8", total=200)
        board.advance(7)
        interceptor = ServerInterceptor("inference", mesh_token="secret", is_ready=lambda: ready)
        server = grpc.aio.server(interceptors=[interceptor])
        stagestatus.StatusServicer(board).register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await stage_pb2_grpc.StageStatusStub(ch).GetStatus(stage_pb2.GetStatusRequest(), timeout=10)
        finally:
            await server.stop(0)
    resp = asyncio.run(main())
    assert (resp.phase, resp.done, resp.total) == ("gating int8", 7, 200)
    assert describe(stagestatus.from_proto(resp)).startswith("gating int8 7/200")
