"""The HTTP front's calls to the gateway (services/openai/app.py, Gateway) are sent again when the
connection was lost before any answer: against a stand-in gateway process that dies as under kill -9
on the first call and is restarted on its port (testing/dying_gateway.py). A stream is sent again
only before its first message."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from keel.gateway.v1 import gateway_pb2
from services.openai.channels import Gateway
from shared.client import Reconnect
from testing.dying_gateway import ANSWER, Keeper
from testing.ports import free_port

# A wait for the connection that outlasts the stand-in's restart (a Python start) on a loaded host.
PATIENT = Reconnect(ready_s=50)


@pytest.fixture
def dying(tmp_path):
    keeper = Keeper(free_port(), tmp_path / "calls")
    keeper.start()
    yield keeper
    keeper.stop()


def _with_gateway(target: str, use, reconnect: Reconnect = PATIENT):
    async def run():
        gateway = Gateway((target,), 4 << 20, reconnect)
        gateway.open()
        try:
            return await use(gateway)
        finally:
            await gateway.close()
    return asyncio.run(run())


def test_a_generation_whose_gateway_dies_is_sent_again(dying):
    resp = _with_gateway(f"127.0.0.1:{dying.port}",
                         lambda gw: gw.generate(gateway_pb2.GenerateRequest(prompt="hi"), (), 60))
    assert resp.text == ANSWER and dying.calls() == 2 and dying.starts >= 2


def test_a_stream_is_sent_again_before_its_first_message(dying):
    async def first(gw):
        call, msg = await gw.open_stream(gateway_pb2.GenerateRequest(prompt="die-first"), (), 60)
        call.cancel()
        return msg
    assert _with_gateway(f"127.0.0.1:{dying.port}", first).delta == ANSWER
    assert dying.calls() == 2


def test_a_stream_is_not_sent_again_after_its_first_message(dying):
    async def rest(gw):
        call, msg = await gw.open_stream(gateway_pb2.GenerateRequest(prompt="die-after-first"), (), 60)
        assert msg.delta == ANSWER
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.read()
        return exc.value.code()
    assert _with_gateway(f"127.0.0.1:{dying.port}", rest) == grpc.StatusCode.UNAVAILABLE
    assert dying.calls() == 1  # the caller had the first message: the stage answers the error, no replay


@pytest.mark.timeout(60)  # a hang, not a timing: the attempts end long before
def test_an_unreachable_gateway_is_given_up_after_the_attempts():
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _with_gateway(f"127.0.0.1:{free_port()}",
                      lambda gw: gw.generate(gateway_pb2.GenerateRequest(prompt="hi"), (), 30),
                      Reconnect(attempts=3, base_s=0.01, cap_s=0.02, ready_s=0.5))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
