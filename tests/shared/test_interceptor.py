"""The one error mapping, both sides: KeelError -> status + ErrorInfo (+ retry hint) -> KeelError."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from shared import client, errors
from shared.interceptor import ServerInterceptor
from shared.meshauth import HEADER as MESH_TOKEN_KEY


class Scripted(tokenizer_pb2_grpc.TokenizerServicer):
    """Raises whatever the test puts in ``self.error``."""

    error: Exception | None = None

    async def Decode(self, request, context):
        if self.error is not None:
            raise self.error
        return tokenizer_pb2.DecodeResponse(text=f"{len(request.ids)} ids")


@pytest_asyncio.fixture
async def server():
    servicer = Scripted()
    srv = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer", mesh_token="s3cret")])
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, ch
    await ch.close()
    await srv.stop(None)


MESH = ((MESH_TOKEN_KEY, "s3cret"),)


async def call(ch, md=MESH, ids=(1, 2)):
    return await tokenizer_pb2_grpc.TokenizerStub(ch).Decode(tokenizer_pb2.DecodeRequest(ids=list(ids)), metadata=md)


@pytest.mark.asyncio
async def test_ok_passes_through(server):
    _, ch = server
    assert (await call(ch)).text == "2 ids"


@pytest.mark.asyncio
@pytest.mark.parametrize("md,reason", [((), "MISSING_MESH_CREDENTIAL"),
                                       (((MESH_TOKEN_KEY, "nope"),), "INVALID_MESH_CREDENTIAL")])
async def test_mesh_credential_required(server, md, reason):
    _, ch = server
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(ch, md=md)
    err = client.translate(exc.value)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and err.reason == reason


@pytest.mark.asyncio
async def test_keel_error_maps_to_status_with_error_info(server):
    servicer, ch = server
    servicer.error = errors.InvalidInput("ids out of range", reason="TOKEN_ID_OUT_OF_RANGE", metadata={"id": 99})
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(ch)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = client.translate(exc.value)
    assert isinstance(err, errors.InvalidInput)
    assert (err.reason, err.metadata["id"], err.metadata["retry_hint"]) == ("TOKEN_ID_OUT_OF_RANGE", "99", "absent")


@pytest.mark.asyncio
async def test_overload_carries_pushback_and_retry_info(server):
    servicer, ch = server
    servicer.error = errors.Overloaded("queue full", retry_after_ms=250)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(ch)
    trailers = dict(exc.value.trailing_metadata())
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailers["grpc-retry-pushback-ms"] == "250"
    err = client.translate(exc.value)
    assert (err.retry_after_ms, err.metadata["retry_hint"], err.code) == (250, "valid", "RESOURCE_EXHAUSTED")


@pytest.mark.asyncio
async def test_unexpected_exception_is_internal_without_leaking_details(server):
    servicer, ch = server
    servicer.error = ZeroDivisionError("secret detail")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call(ch)
    assert exc.value.code() == grpc.StatusCode.INTERNAL
    assert "secret detail" not in exc.value.details()
    assert client.translate(exc.value).reason == "INTERNAL"


@pytest.mark.asyncio
async def test_malformed_body_is_invalid_argument_not_internal(server):
    _, ch = server
    raw = ch.unary_unary("/keel.tokenizer.v1.Tokenizer/Decode")  # bytes in, bytes out
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await raw(b"\x0a\xff\xff\xff", metadata=MESH)  # field 1, length that overruns the buffer
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.translate(exc.value).reason == "MALFORMED_REQUEST"


@pytest.mark.asyncio
async def test_invalid_pushback_is_marked_invalid():
    """A negative hint must read as 'invalid' so the gateway does not retry on it."""
    from shared.client import _retry_hint
    assert _retry_hint({"grpc-retry-pushback-ms": "-5"}, None) == ("invalid", None)
    assert _retry_hint({"grpc-retry-pushback-ms": "soon"}, None) == ("invalid", None)
    assert _retry_hint({}, None) == ("absent", None)


def _requests(code: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("keel_requests_total",
                                     {"service": "tokenizer", "method": "Decode", "code": code}) or 0.0


@pytest.mark.asyncio
async def test_every_call_is_counted_under_its_own_code(server):
    servicer, ch = server
    ok, bad = _requests("OK"), _requests("INVALID_ARGUMENT")
    await call(ch)
    await call(ch)
    servicer.error = errors.InvalidInput("no", reason="EMPTY_PROMPT")
    with pytest.raises(grpc.aio.AioRpcError):
        await call(ch)
    servicer.error = None
    await call(ch)
    assert (_requests("OK") - ok, _requests("INVALID_ARGUMENT") - bad) == (3, 1)


class _Details:
    def __init__(self, method: str):
        self.method, self.invocation_metadata = method, ()


class _Context:
    """The few calls the interceptor makes on a grpc.aio servicer context."""

    def invocation_metadata(self):
        return ((MESH_TOKEN_KEY, "s3cret"),)

    def peer(self):
        return "ipv4:127.0.0.1:1"

    async def send_initial_metadata(self, metadata):
        pass

    def set_trailing_metadata(self, metadata):
        pass


@pytest.mark.asyncio
async def test_a_method_whose_handler_changes_gets_the_new_one():
    """The wrapped handler is made once per method, but never outlives the handler it wraps."""
    interceptor = ServerInterceptor("tokenizer", mesh_token="s3cret")
    seen = []

    def handler(tag):
        async def behaviour(request, context):
            seen.append(tag)
        return grpc.unary_unary_rpc_method_handler(behaviour)

    current = handler("first")

    async def continuation(details):
        return current

    method = "/keel.tokenizer.v1.Tokenizer/Decode"
    wrapped = await interceptor.intercept_service(continuation, _Details(method))
    await wrapped.unary_unary(tokenizer_pb2.DecodeRequest(), _Context())
    current = handler("second")
    wrapped = await interceptor.intercept_service(continuation, _Details(method))
    await wrapped.unary_unary(tokenizer_pb2.DecodeRequest(), _Context())
    assert seen == ["first", "second"]


@pytest.mark.asyncio
async def test_a_stream_cancelled_while_its_answer_is_written_is_counted_cancelled():
    """A client that cancels while grpc is writing a message finds the handler's generator at
    its yield: grpc closes it (GeneratorExit), it is not cancelled. Still a CANCELLED call."""
    from prometheus_client import REGISTRY

    async def endless(request, context):
        while True:  # never awaits: the cancel lands while a message is being written
            yield tokenizer_pb2.DecodeResponse(text="x" * 4000)
    handler = grpc.method_handlers_generic_handler("keel.test.v1.Streams", {
        "Endless": grpc.unary_stream_rpc_method_handler(endless, tokenizer_pb2.DecodeRequest.FromString,
                                                        tokenizer_pb2.DecodeResponse.SerializeToString)})
    srv = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer", mesh_token="s3cret")])
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()

    def count(code: str) -> float:
        return REGISTRY.get_sample_value("keel_requests_total",
                                         {"service": "tokenizer", "method": "Endless", "code": code}) or 0.0
    before = count("CANCELLED"), count("OK")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        for _ in range(3):
            endless = ch.unary_stream("/keel.test.v1.Streams/Endless", tokenizer_pb2.DecodeRequest.SerializeToString,
                                      tokenizer_pb2.DecodeResponse.FromString)
            call = endless(tokenizer_pb2.DecodeRequest(), metadata=MESH)
            for _ in range(3):
                await call.read()
            call.cancel()
    for _ in range(100):
        if count("CANCELLED") - before[0] == 3:
            break
        await asyncio.sleep(0.05)
    assert (count("CANCELLED") - before[0], count("OK") - before[1]) == (3, 0)
    await srv.stop(None)


@pytest.mark.asyncio
async def test_a_stream_closed_from_another_context_leaves_no_stray_task_exception():
    """Issue 44: a cancelled stream's handler generator, finalized by asyncio in a task of its
    own (another context), raised ValueError resetting the log context variables: "Task exception
    was never retrieved" in the gateway's log. The close must end quietly."""
    import contextvars

    interceptor = ServerInterceptor("tokenizer", mesh_token="s3cret")

    async def two(request, context):
        yield tokenizer_pb2.DecodeResponse(text="a")
        yield tokenizer_pb2.DecodeResponse(text="b")

    async def continuation(details):
        return grpc.unary_stream_rpc_method_handler(two)

    wrapped = await interceptor.intercept_service(continuation, _Details("/keel.test.v1.Streams/Two"))
    stream = wrapped.unary_stream(tokenizer_pb2.DecodeRequest(), _Context())
    assert (await stream.__anext__()).text == "a"
    # as asyncio's async-generator finalizer does: aclose() in a new task, in another context
    await asyncio.get_running_loop().create_task(stream.aclose(), context=contextvars.Context())
    assert interceptor.inflight == 0
