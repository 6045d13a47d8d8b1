"""What a client outside the mesh sees from the public (authenticating) stage: its trace joined,
the trace id in the initial metadata, and error details without the gateway's retry bookkeeping.
A real grpc server with the real interceptor; the servicer is scripted."""
from __future__ import annotations

import logging

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from shared import errors
from shared.interceptor import TRACE_ID_KEY, ServerInterceptor

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"


class Scripted(tokenizer_pb2_grpc.TokenizerServicer):
    error: Exception | None = None

    async def Decode(self, request, context):
        if self.error is not None:
            raise self.error
        return tokenizer_pb2.DecodeResponse(text="ok")


@pytest.fixture(scope="module", autouse=True)
def sdk_tracing():
    """A recording tracer provider, so that a call without a caller's trace gets a new trace id."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())


@pytest_asyncio.fixture
async def public():
    servicer = Scripted()
    srv = grpc.aio.server(interceptors=[ServerInterceptor("gateway", authenticate=lambda md, peer: "key-1")])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, tokenizer_pb2_grpc.TokenizerStub(ch)
    await ch.close()
    await srv.stop(None)


def _error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = status_pb2.Status.FromString(dict(err.trailing_metadata())["grpc-status-details-bin"])
    info = error_details_pb2.ErrorInfo()
    next(d for d in status.details if d.Is(info.DESCRIPTOR)).Unpack(info)
    return info


@pytest.mark.asyncio
async def test_a_valid_traceparent_is_joined_and_the_trace_id_comes_first(public):
    _, stub = public
    call = stub.Decode(tokenizer_pb2.DecodeRequest(ids=[1]), metadata=(("traceparent", TRACEPARENT),))
    initial = dict(await call.initial_metadata())
    await call
    assert initial[TRACE_ID_KEY] == CALLER_TRACE
    assert dict(await call.trailing_metadata())[TRACE_ID_KEY] == CALLER_TRACE


@pytest.mark.asyncio
async def test_an_invalid_traceparent_is_logged_and_a_new_trace_started(public, caplog):
    _, stub = public
    bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"  # all-zero trace id: invalid
    with caplog.at_level(logging.WARNING, logger="keel.rpc"):
        call = stub.Decode(tokenizer_pb2.DecodeRequest(ids=[1]), metadata=(("traceparent", bad),))
        initial = dict(await call.initial_metadata())
        await call
    trace_id = initial[TRACE_ID_KEY]
    assert len(trace_id) == 32 and trace_id != "0" * 32
    assert any("invalid traceparent" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_the_trace_id_reaches_a_failed_call_in_its_initial_metadata(public):
    servicer, stub = public
    servicer.error = errors.InvalidInput("nope", reason="EMPTY_PROMPT")
    call = stub.Decode(tokenizer_pb2.DecodeRequest(ids=[1]), metadata=(("traceparent", TRACEPARENT),))
    initial = dict(await call.initial_metadata())
    with pytest.raises(grpc.aio.AioRpcError):
        await call
    assert initial[TRACE_ID_KEY] == CALLER_TRACE


@pytest.mark.asyncio
async def test_retry_bookkeeping_stays_out_of_a_clients_error_details(public):
    servicer, stub = public
    servicer.error = errors.DeadlineExpired("deadline exceeded: ...", metadata={
        "upstream": "tokenizer", "retry_stop": "deadline", "attempts": "2", "retry_hint": "absent"})
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Decode(tokenizer_pb2.DecodeRequest(ids=[1]))
    info = _error_info(exc.value)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (info.domain, info.reason, dict(info.metadata)) == (errors.DOMAIN, "DEADLINE_EXCEEDED",
                                                               {"upstream": "tokenizer"})
