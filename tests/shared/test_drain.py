"""The shared server bootstrap's drain, on a real stage server in this process (SIGTERM to the
test process reaches only the serving loop's handler): a call that outlives the grace period ends
UNAVAILABLE with reason SHUTTING_DOWN and a retry hint, and a call that arrives during the drain is
refused the same way."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from shared import client, errors
from shared.config import ServerConfig
from shared.server import serve
from testing.ports import free_port
from tests.shared.stage_stub import HangingStage, serving


@pytest.mark.asyncio
async def test_drain_cuts_the_call_it_cannot_finish_with_shutting_down_and_refuses_new_ones():
    port = free_port()
    stage = HangingStage()
    server = asyncio.create_task(serve(stage, ServerConfig(port=port, drain_grace_s=1.0)))
    await asyncio.wait_for(serving(port), 30)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        in_flight = stub.Encode(tokenizer_pb2.EncodeRequest(text=b"hi"))  # no deadline: only the drain ends it
        while not stage.servicer.calls:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.2)  # the drain has begun
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.Encode(tokenizer_pb2.EncodeRequest(text=b"hi"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            await in_flight
    await asyncio.wait_for(server, 30)
    for exc in (late.value, cut.value):
        err = client.translate(exc)
        assert (err.code, err.reason) == ("UNAVAILABLE", errors.SHUTTING_DOWN), exc.details()
        assert err.retry_after_ms and err.retry_after_ms > 0


@pytest.mark.asyncio
async def test_drain_lets_a_call_that_finishes_within_the_grace_period_finish():
    port = free_port()
    stage = HangingStage("slow")
    server = asyncio.create_task(serve(stage, ServerConfig(port=port, drain_grace_s=30.0)))
    await asyncio.wait_for(serving(port), 30)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = tokenizer_pb2_grpc.TokenizerStub(ch).Encode(tokenizer_pb2.EncodeRequest(text=b"hi"), timeout=30)
        while not stage.servicer.calls:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert list((await call).input_ids) == [os.getpid()]
    await asyncio.wait_for(server, 30)
