"""The OpenAI-compatible HTTP API as a Starlette app: every request becomes one gateway call.

The gateway does all the policy: the caller's ``Authorization: Bearer`` (or ``x-api-key``) header is
its API key, ``traceparent``/``tracestate`` join the caller's trace, its rate limits, deadlines,
retries and refusals apply as to any gRPC client. This app only converts: HTTP JSON -> protobuf
(services/openai/convert.py), and the answer, its trace id (``x-keel-trace-id``) and any error
(services/openai/httperrors.py) back. A streamed answer is server-sent events ending in
``data: [DONE]``; the HTTP status is sent once the gateway's first message (or its refusal) is
there, so a refused stream is an ordinary error response. A client that goes away mid-stream
cancels the gateway call, which cancels the generation in the inference stage.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.openai import convert, httperrors
from services.openai.schemas import ChatBody, CompletionBody, invalid_body, parse
from shared import client, errors, proxyauth
from shared.interceptor import NOT_SERVING_RETRY_MS, TRACE_ID_KEY
from shared.modelfile import MODEL_ID

log = logging.getLogger("keel.openai")

# Request headers passed on to the gateway as gRPC metadata (the API key and the W3C trace context).
FORWARDED = ("authorization", "x-api-key", "traceparent", "tracestate")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# The request's deadline in milliseconds (a stream's whole stream), as a gRPC client sets one;
# absent: the gateway's default deadline.
DEADLINE_HEADER = "x-keel-deadline-ms"


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode()


def _printable(value: str) -> bool:
    """gRPC metadata values are printable ASCII; anything else is not sent on."""
    return all(" " <= c <= "~" for c in value)


def metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's forwarded headers, and the proxy credential with the caller's address: the
    gateway then counts the caller's failed authentications by that address, not this server's."""
    client_address = request.client.host if request.client else ""
    return (*((name, v) for name in FORWARDED for v in request.headers.getlist(name) if _printable(v)),
            *proxyauth.on_behalf_of(client_address))


def deadline_s(request: Request) -> float | None:
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) == 0:
        raise errors.InvalidInput(f"{DEADLINE_HEADER} must be a positive integer (milliseconds)",
                                  reason="INVALID_HEADER", metadata={"field": DEADLINE_HEADER})
    return int(raw) / 1000


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def translate(exc: grpc.aio.AioRpcError) -> errors.KeelError:
    """The gateway's error; a gateway that did not answer at all is CONNECTION_LOST, retry later."""
    err = client.translate(exc)
    if err.code == "UNAVAILABLE" and err.reason == "UNAVAILABLE":
        return errors.NotReady("the gateway did not answer; retry after the hint", reason=errors.CONNECTION_LOST,
                               retry_after_ms=NOT_SERVING_RETRY_MS)
    return err


def error_response(err: errors.KeelError, trace_id: str = "") -> JSONResponse:
    trace_id = trace_id or err.metadata.get("trace_id", "")
    return JSONResponse(httperrors.error_body(err), status_code=httperrors.http_status(err),
                        headers=httperrors.headers(err, trace_id))


class Gateway:
    """Channels to the gateway replicas (round robin), opened on the serving event loop."""

    def __init__(self, targets: tuple[str, ...], max_message_bytes: int):
        self.targets, self.max_message_bytes = targets, max_message_bytes
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[gateway_pb2_grpc.GatewayStub] = []
        self._next = 0

    def open(self) -> None:
        self._channels = [client.channel(t, max_message_bytes=self.max_message_bytes) for t in self.targets]
        self._stubs = [gateway_pb2_grpc.GatewayStub(ch) for ch in self._channels]

    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        self._next = (self._next + 1) % len(self._stubs)
        return self._stubs[self._next]

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


class Api:
    def __init__(self, gateway: Gateway, max_body_bytes: int):
        self.gateway, self.max_body_bytes = gateway, max_body_bytes
        self.serving = False

    async def _json(self, request: Request):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise errors.Overloaded(f"the body is larger than {self.max_body_bytes} bytes",
                                        reason="MESSAGE_TOO_LARGE")
        try:
            return json.loads(body)
        except ValueError as exc:  # also bytes that are not UTF-8
            raise invalid_body("(body)", f"the body is not JSON: {exc}") from None

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatBody, convert.chat_request)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionBody, convert.completion_request)

    async def _generate(self, request: Request, cls, build) -> Response:
        try:
            timeout = deadline_s(request)
            body = parse(cls, await self._json(request))
            req = build(body)
        except errors.KeelError as err:
            return error_response(err)
        chat = cls is ChatBody
        logprobs = req.sampling.logprobs
        md = metadata(request)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(req, md, timeout, chat, logprobs, include_usage)
        try:
            resp = await self._unary(request, self.gateway.stub().Generate(req, metadata=md, timeout=timeout))
        except grpc.aio.AioRpcError as exc:
            return error_response(translate(exc))
        except errors.Cancelled as err:
            return error_response(err)
        reply = convert.Reply.start(chat, resp.trace_id)
        return JSONResponse(convert.answer(reply, resp, logprobs), headers={TRACE_ID_KEY: resp.trace_id})

    @staticmethod
    async def _unary(request: Request, call):
        """The call's answer; a client that goes away first cancels it (so its generation stops)."""
        answer = asyncio.ensure_future(call)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():
            call.cancel()
            raise errors.Cancelled("the client went away", reason="CANCELLED")
        return answer.result()

    async def _stream(self, req: gateway_pb2.GenerateRequest, md, timeout: float | None, chat: bool,
                      logprobs: bool, include_usage: bool) -> Response:
        call = self.gateway.stub().GenerateStream(req, metadata=md, timeout=timeout)
        try:
            first = await call.read()
            trace_id = dict(await call.initial_metadata() or ()).get(TRACE_ID_KEY, "")
        except grpc.aio.AioRpcError as exc:
            return error_response(translate(exc))
        if first is grpc.aio.EOF:  # the gateway always ends a stream with its summary or a status
            return error_response(errors.NotReady("the gateway's stream ended without an answer",
                                                  reason="STREAM_TRUNCATED", retry_after_ms=NOT_SERVING_RETRY_MS))
        shaper = convert.StreamShaper(convert.Reply.start(chat, trace_id), convert.model_of(req.adapter),
                                      logprobs, include_usage)
        return StreamingResponse(self._events(call, first, shaper), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, TRACE_ID_KEY: trace_id})

    async def _events(self, call, first, shaper: convert.StreamShaper) -> AsyncIterator[bytes]:
        """SSE frames of one stream. A failure after the first event is an ``error`` event (OpenAI's
        error object) in place of ``[DONE]``. Cancelled (the client went away): the call is too."""
        try:
            ev = first
            while ev is not grpc.aio.EOF:
                yield b"".join(sse(chunk) for chunk in shaper.event(ev))
                ev = await call.read()
            yield sse("[DONE]")
        except grpc.aio.AioRpcError as exc:
            yield sse(httperrors.error_body(translate(exc)))
        finally:
            call.cancel()

    async def models(self, request: Request) -> Response:
        try:
            resp = await self.gateway.stub().ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata(request),
                                                        timeout=deadline_s(request))
        except errors.KeelError as err:
            return error_response(err)
        except grpc.aio.AioRpcError as exc:
            return error_response(translate(exc))
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "keel"} for name in (MODEL_ID, *resp.adapters)]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        status = "SERVING" if self.serving else "NOT_SERVING"
        return JSONResponse({"status": status}, status_code=200 if self.serving else 503)


async def _not_found(request: Request, exc) -> Response:
    status = getattr(exc, "status_code", 404)
    err = errors.NotFound(f"no route {request.method} {request.url.path}", reason="NOT_FOUND")
    body = httperrors.error_body(err)
    return JSONResponse(body, status_code=status)


def build_app(api: Api, lifespan=None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_found}, lifespan=lifespan)
