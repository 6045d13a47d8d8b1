"""The OpenAI-compatible HTTP API as a Starlette app: every request becomes one gateway call.

The gateway does all the policy: the caller's ``Authorization: Bearer`` (or ``x-api-key``) header is
its API key, ``traceparent``/``tracestate`` join the caller's trace, its rate limits, deadlines,
retries and refusals apply as to any gRPC client. This app only converts: HTTP JSON -> protobuf
(services/openai/convert.py), and the answer, its trace id (``x-keel-trace-id``) and any error
(services/openai/httperrors.py) back. A streamed answer is server-sent events ending in
``data: [DONE]``; the HTTP status is sent once the gateway's first message (or its refusal) is
there, so a refused stream is an ordinary error response. A client that goes away mid-stream
cancels the gateway call, which cancels the generation in the inference stage.

What a client may send is bounded before the gateway sees it (services/openai/limits.py): the
connection's timeouts and header limits (connection.py), the headers read here (headers.py), the
body's size and depth (body.py); a body that may be large is read only once the gateway has
accepted the caller's key. Nothing a client sends is answered 500.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import grpc
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from keel.gateway.v1 import gateway_pb2
from services.openai import body as bodies
from services.openai import convert, httperrors, responses
from services.openai.channels import Gateway
from services.openai.headers import deadline_s, has_key, metadata
from services.openai.limits import EdgeLimits
from services.openai.responses_schemas import ResponsesBody
from services.openai.schemas import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, parse
from shared import client, errors
from shared.interceptor import NOT_SERVING_RETRY_MS, TRACE_ID_KEY

log = logging.getLogger("keel.openai")

# The trailer every gateway error carries (google.rpc.Status: reason and metadata).
STATUS_DETAILS = "grpc-status-details-bin"
# The statuses gRPC itself ends a call with when the connection or the deadline fails.
TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# An answer given before the body was read closes the connection (the rest of the body is not read).
CLOSE = {"connection": "close"}


def dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else dumps(obj)}\n\n".encode()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def translate(exc: grpc.aio.AioRpcError) -> errors.KeelError:
    """The gateway's error (it always sends its google.rpc.Status). A status without one is gRPC's
    own: the gateway did not answer, or its connection dropped (even mid-stream, "Stream removed"),
    or this stage's deadline fired first; its text names transport internals, so the client gets
    a Keel reason and plain words instead (the log keeps gRPC's text)."""
    if exc.code() not in TRANSPORT_CODES or any(k == STATUS_DETAILS for k, _ in exc.trailing_metadata() or ()):
        return client.translate(exc)
    log.info("the gateway call ended without the gateway's status",
             extra={"code": exc.code().name, "detail": exc.details()})
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DeadlineExpired("the deadline ran out before the gateway answered", reason="DEADLINE_EXCEEDED")
    if exc.code() == grpc.StatusCode.CANCELLED:
        return errors.Cancelled("the gateway call was cancelled", reason="CANCELLED")
    return errors.NotReady("the connection to the gateway was lost before it answered in full; retry after the hint",
                           reason=errors.CONNECTION_LOST, retry_after_ms=NOT_SERVING_RETRY_MS)


def error_response(err: errors.KeelError, trace_id: str = "", extra: dict | None = None) -> JSONResponse:
    trace_id = trace_id or err.metadata.get("trace_id", "")
    return JSONResponse(httperrors.error_body(err), status_code=httperrors.http_status(err),
                        headers={**httperrors.headers(err, trace_id), **(extra or {})})


class Chunks:
    """Chat and completion chunks as SSE: each chunk one ``data:`` frame, ``data: [DONE]`` at the end,
    OpenAI's error object in its place after a failure. (services/openai/responses.py's ``Events``
    frames /v1/responses' typed events the same way.)"""

    def __init__(self, shaper: convert.StreamShaper):
        self.shaper = shaper

    def event(self, ev: gateway_pb2.GenerateStreamResponse, i: int) -> bytes:
        return b"".join(sse(chunk) for chunk in self.shaper.event(ev, i))

    def end(self) -> bytes:
        return sse("[DONE]")

    def failed(self, err: errors.KeelError) -> bytes:
        return sse(httperrors.error_body(err))


class Api:
    def __init__(self, gateway: Gateway, max_body_bytes: int, limits: EdgeLimits):
        self.gateway, self.max_body_bytes, self.limits = gateway, max_body_bytes, limits
        self.serving = False

    async def _read(self, request: Request, md) -> bytes:
        """The body, read within the limits. One that may be large (over
        ``preauth_body_bytes``, or chunked) is read only once the gateway has accepted the key:
        a caller without a valid key cannot make this stage buffer megabytes."""
        size = bodies.declared_size(request.headers.get("content-length"), self.max_body_bytes)
        if size is None or size > self.limits.preauth_body_bytes:
            if not has_key(request):
                raise errors.Unauthenticated("no API key: send it in 'x-api-key' or 'authorization: Bearer'",
                                             reason="MISSING_API_KEY")
            await self._authenticated(md)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise bodies.too_large(self.max_body_bytes)
        return bytes(body)

    async def _authenticated(self, md) -> None:
        """Asks the gateway to check the caller's key (ListModels: authenticated, and counted
        against the key's rate limit and, refused, the address's failure budget as any call)."""
        try:
            await self.gateway.stub().ListModels(gateway_pb2.ListModelsRequest(), metadata=md,
                                                 timeout=self.limits.header_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc) from None

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatBody, lambda body: [convert.chat_request(body)])

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionBody, convert.completion_requests)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: one generation of the conversation in ``input`` (services/openai/responses.py)."""
        parsed = await self._parsed(request, ResponsesBody, responses.request)
        if isinstance(parsed, Response):
            return parsed
        req, md, timeout, body = parsed
        if body.stream:
            return await self._streamed([req], md, timeout, lambda trace_id: responses.Events(
                responses.Reply.start(body, trace_id), convert.model_of(req.adapter)), responses.in_its_terms)
        try:
            resp = await self._unary(request, self.gateway.generate(req, md, timeout))
        except grpc.aio.AioRpcError as exc:
            return error_response(responses.in_its_terms(translate(exc)))
        except errors.Cancelled as err:
            return error_response(err)
        reply = responses.Reply.start(body, resp.trace_id)
        return JSONResponse(reply.finished(resp, responses.has_message(resp)), headers={TRACE_ID_KEY: resp.trace_id})

    async def _parsed(self, request: Request, cls, build):
        """(the gateway request ``build`` makes of the body, the call's metadata, its deadline, the
        body), read within the limits; or the refusal's Response."""
        read = False
        try:
            timeout = deadline_s(request, self.limits)
            md = metadata(request, self.limits)
            raw = await self._read(request, md)
            read = True
            body = parse(cls, bodies.parse_json(raw, self.limits.max_json_depth))
            return bodies.converted(build, body), md, timeout, body
        except errors.KeelError as err:
            # Answered before the whole body was read, the connection is closed (the rest unread).
            return error_response(err, extra=None if read else CLOSE)
        except ClientDisconnect:
            log.info("the client went away while sending its body", extra={"path": request.url.path})
            return Response(status_code=499)

    async def _generate(self, request: Request, cls, build) -> Response:
        """``build(body)`` makes one gateway request per prompt; each prompt gets `n` choices, run side
        by side, numbered prompt-major (prompt k's choices are k*n .. k*n+n-1, as OpenAI numbers them)."""
        parsed = await self._parsed(request, cls, build)
        if isinstance(parsed, Response):
            return parsed
        prompts, md, timeout, body = parsed
        n = 1 if body.n is None else body.n
        if not 1 <= n <= self.limits.max_choices:
            return error_response(errors.InvalidInput(f"n must be in 1..{self.limits.max_choices}, got {n}",
                                                      reason="N_OUT_OF_RANGE", metadata={"field": "n"}))
        if n > 1 and body.temperature == 0:  # greedy: every choice would be the same tokens
            return error_response(errors.InvalidInput(
                f"n={n} with temperature 0 asks for {n} copies of one greedy answer; sample (temperature > 0) "
                "or send n=1", reason="N_WITH_GREEDY", metadata={"field": "n"}))
        if len(prompts) > self.limits.max_prompts:
            return error_response(errors.InvalidInput(
                f"at most {self.limits.max_prompts} prompts per request, got {len(prompts)}",
                reason="TOO_MANY_PROMPTS", metadata={"field": "prompt"}))
        reqs = [choice for r in prompts for choice in convert.choices_of(r, n)]
        chat = cls is ChatBody
        terms = (lambda err: err) if chat else convert.in_completion_terms
        logprobs = reqs[0].sampling.logprobs
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return await self._stream(reqs, md, timeout, chat, logprobs, include_usage, n, terms)
        scoring = not chat and convert.scoring_only(body)
        try:
            resps = await self._unary(request, _all(self.gateway.generate(r, md, timeout) for r in reqs))
            scored = await self._prompt_texts(request, body.prompt, md, timeout) if scoring else None
        except grpc.aio.AioRpcError as exc:
            return error_response(terms(translate(exc)))
        except errors.Cancelled as err:
            return error_response(err)
        reply = convert.Reply.start(chat, resps[0].trace_id)
        return JSONResponse(convert.answer(reply, resps, logprobs, n, scored),
                            headers={TRACE_ID_KEY: resps[0].trace_id})

    async def _prompt_texts(self, request: Request, prompts: list, md, timeout: float | None) -> list[str]:
        """Each prompt's text: a text as sent, token ids as the gateway decodes them."""
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(p)
                continue
            call = self.gateway.stub().Detokenize(gateway_pb2.DetokenizeRequest(token_ids=p), metadata=md,
                                                  timeout=timeout)
            out.append((await self._unary(request, call)).text)
        return out

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
            answer.cancel()  # cancels the gRPC call it awaits
            raise errors.Cancelled("the client went away", reason="CANCELLED")
        return answer.result()

    async def _stream(self, reqs: list[gateway_pb2.GenerateRequest], md, timeout: float | None, chat: bool,
                      logprobs: bool, include_usage: bool, per_prompt: int, terms) -> Response:
        """One stream of every choice's events, interleaved as they come (each chunk names its choice)."""
        def chunks(trace_id: str) -> Chunks:
            return Chunks(convert.StreamShaper(convert.Reply.start(chat, trace_id), convert.model_of(reqs[0].adapter),
                                               logprobs, include_usage, len(reqs), per_prompt))
        return await self._streamed(reqs, md, timeout, chunks, terms)

    async def _streamed(self, reqs: list[gateway_pb2.GenerateRequest], md, timeout: float | None,
                        framing, terms=lambda err: err) -> Response:
        """The SSE response of the streams of ``reqs``, framed by ``framing(trace id)`` (``Chunks``); a
        refusal before the first message is an error response, its field named by ``terms``."""
        try:
            opened = await _all(self.gateway.open_stream(r, md, timeout) for r in reqs)
        except grpc.aio.AioRpcError as exc:
            return error_response(terms(translate(exc)))
        trace_id = dict(await opened[0][0].initial_metadata() or ()).get(TRACE_ID_KEY, "")
        if any(first is grpc.aio.EOF for _, first in opened):  # the gateway ends a stream with its summary or a status
            for call, _ in opened:
                call.cancel()
            return error_response(errors.NotReady("the gateway's stream ended without an answer",
                                                  reason="STREAM_TRUNCATED", retry_after_ms=NOT_SERVING_RETRY_MS))
        return StreamingResponse(self._events(opened, framing(trace_id)), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, TRACE_ID_KEY: trace_id})

    async def _events(self, opened, frames) -> AsyncIterator[bytes]:
        """SSE frames of the choices' streams, as ``frames`` (``Chunks``, or responses.Events) makes
        them. A failure after the first event is an ``error`` event in place of the stream's end.
        Cancelled (the client went away): so are the calls."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, call, ev) -> None:
            while ev is not grpc.aio.EOF:
                await queue.put((i, ev))
                ev = await call.read()

        pumps = [asyncio.ensure_future(pump(i, call, first)) for i, (call, first) in enumerate(opened)]
        ended = asyncio.ensure_future(asyncio.gather(*pumps))
        try:
            while True:
                got = asyncio.ensure_future(queue.get())
                await asyncio.wait({got, ended}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    break
                i, ev = got.result()
                yield frames.event(ev, i)
            while not queue.empty():  # what the streams sent before the last one ended
                i, ev = queue.get_nowait()
                yield frames.event(ev, i)
            ended.result()  # a stream's failure, if one failed
            yield frames.end()
        except grpc.aio.AioRpcError as exc:
            yield frames.failed(translate(exc))
        finally:
            for task in pumps:
                task.cancel()
            ended.cancel()
            for call, _ in opened:
                call.cancel()

    async def tokenize(self, request: Request) -> Response:
        return await self._tokens(request, TokenizeBody, convert.tokenize_request, "Tokenize", convert.tokenized)

    async def detokenize(self, request: Request) -> Response:
        return await self._tokens(request, DetokenizeBody, convert.detokenize_request, "Detokenize",
                                  convert.detokenized)

    async def _tokens(self, request: Request, cls, build, method: str, shape) -> Response:
        """vLLM's /tokenize or /detokenize: one gateway call of ``method``, its answer as ``shape`` makes it."""
        parsed = await self._parsed(request, cls, build)
        if isinstance(parsed, Response):
            return parsed
        req, md, timeout, body = parsed
        # A /tokenize of a prompt (not messages) is refused naming `prompt`, as /v1/completions.
        terms = convert.in_completion_terms if getattr(body, "prompt", None) is not None else (lambda err: err)
        call = getattr(self.gateway.stub(), method)(req, metadata=md, timeout=timeout)
        try:
            resp = await self._unary(request, call)
            trace_id = dict(await call.initial_metadata() or ()).get(TRACE_ID_KEY, "")
        except grpc.aio.AioRpcError as exc:
            return error_response(terms(translate(exc)))
        except errors.Cancelled as err:
            return error_response(err)
        return JSONResponse(shape(resp), headers={TRACE_ID_KEY: trace_id} if trace_id else None)

    async def _model_ids(self, request: Request) -> tuple[str, ...]:
        """The base model's name, then every adapter the gateway lists ("id@version")."""
        try:
            resp = await self.gateway.stub().ListModels(gateway_pb2.ListModelsRequest(),
                                                        metadata=metadata(request, self.limits),
                                                        timeout=deadline_s(request, self.limits))
        except grpc.aio.AioRpcError as exc:
            raise translate(exc) from None
        return (convert.MODEL_ID, *resp.adapters)

    async def models(self, request: Request) -> Response:
        try:
            ids = await self._model_ids(request)
        except errors.KeelError as err:
            return error_response(err)
        return JSONResponse({"object": "list", "data": [model_object(name) for name in ids]})

    async def model(self, request: Request) -> Response:
        """One model, as `model` may name it: the base model, "id@version", or "id" (its newest
        accepted version); else 404 ADAPTER_NOT_FOUND, as a generation naming it would be."""
        name = request.path_params["model"]
        try:
            ids = await self._model_ids(request)
        except errors.KeelError as err:
            return error_response(err)
        if name not in ids and not any(i.partition("@")[0] == name for i in ids[1:]):
            return error_response(errors.NotFound(f"no model or adapter {name[:140]!r}", reason="ADAPTER_NOT_FOUND",
                                                  metadata={"adapter": name[:140]}))
        return JSONResponse(model_object(name))

    async def health(self, request: Request) -> Response:
        status = "SERVING" if self.serving else "NOT_SERVING"
        return JSONResponse({"status": status}, status_code=200 if self.serving else 503)


async def _all(calls):
    """Every call's result, in order; the first failure cancels the others (their generations stop)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "keel"}


async def _no_route(request: Request, exc) -> Response:
    """404 NOT_FOUND for an unknown path; 405 METHOD_NOT_ALLOWED (with ``Allow``) for a known one."""
    headers = getattr(exc, "headers", None) or {}
    if getattr(exc, "status_code", 404) == 405:
        err = errors.InvalidInput(f"{request.method} is not served on {request.url.path}; "
                                  f"use {headers.get('Allow', 'another method')}", reason="METHOD_NOT_ALLOWED")
    else:
        err = errors.NotFound(f"no route {request.method} {request.url.path}", reason="NOT_FOUND")
    return JSONResponse(httperrors.error_body(err), status_code=httperrors.http_status(err), headers=headers)


def build_app(api: Api, lifespan=None) -> Starlette:
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model}", api.model, methods=["GET"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),  # vLLM's paths: no /v1
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={404: _no_route, 405: _no_route}, lifespan=lifespan)
