"""The one server-side interceptor: auth, readiness, trace context, logs, metrics, error mapping.

Every stage's servicer raises ``shared.errors`` exceptions (or returns); this module alone turns
them into gRPC statuses with google.rpc.ErrorInfo (and RetryInfo plus a ``grpc-retry-pushback-ms``
trailer for recoverable errors). An exception that is not a KeelError is a bug: INTERNAL, logged
with its stack. A request body that fails to parse (invalid UTF-8 in a string field, garbage bytes)
is INVALID_ARGUMENT with reason MALFORMED_REQUEST -- never INTERNAL.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from typing import Callable, Mapping, Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from opentelemetry import context as otel_context
from opentelemetry import trace

from shared import errors, meshauth, metrics, tracing
from shared.logging import rpc_var, trace_id_var

log = logging.getLogger("keel.rpc")
TRACE_ID_KEY = "x-keel-trace-id"
# Answered before SERVING and without credentials: health, reflection and the stage status
# (shared/stagestatus.py), which tell what a process is doing, never what a request holds.
_EXEMPT = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/keel.stage.v1.StageStatus/")
NOT_SERVING_RETRY_MS = 1000  # the hint on UNAVAILABLE from a stage warming up or shutting down
CUT_WAIT_S = 1.0  # how long the drain waits for cut calls to send their status
_NEW_TRACE = otel_context.Context()  # a span started in it is the root of a new trace


class MalformedRequest:
    """Stands in for a request whose bytes did not parse; the interceptor rejects it."""

    def __init__(self, error: Exception):
        self.error = error


def tolerant(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf raises DecodeError or others on bad bytes
            return MalformedRequest(exc)
    return parse


def _check_parsed(request) -> None:
    if isinstance(request, MalformedRequest):
        raise errors.InvalidInput(f"request body does not parse: {request.error}", reason="MALFORMED_REQUEST")


async def _parsed(requests):
    """A request stream's messages; one whose bytes did not parse ends the call as MALFORMED_REQUEST."""
    async for request in requests:
        _check_parsed(request)
        yield request


def to_status(err: errors.KeelError, trace_id: str = "", *,
              public: bool = False) -> tuple[grpc.StatusCode, str, tuple]:
    """KeelError -> (code, message, trailing metadata with the rich status). ``public``: the
    caller is a client outside the mesh, so the gateway's retry bookkeeping stays out."""
    code = grpc.StatusCode[err.code]
    metadata = {k: v for k, v in err.metadata.items() if not (public and k in errors.INTERNAL_METADATA_KEYS)}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=errors.DOMAIN, metadata=metadata)
    details = [info]
    trailers: list[tuple[str, str | bytes]] = []
    if err.retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(err.retry_after_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
        trailers.append(("grpc-retry-pushback-ms", str(err.retry_after_ms)))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    status = status_pb2.Status(code=code.value[0], message=err.message, details=packed)
    trailers.append(("grpc-status-details-bin", status.SerializeToString()))
    if trace_id:
        trailers.append((TRACE_ID_KEY, trace_id))
    return code, err.message, tuple(trailers)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every non-health RPC of a stage.

    mesh_token: stages accept only calls carrying it (the gateway passes ``authenticate`` instead).
    is_ready: False while warming up -> UNAVAILABLE NOT_SERVING with a retry hint.
    A stage that authenticates its callers itself (``authenticate``: the gateway) is the public
    one: a caller's invalid ``traceparent`` is logged and a new trace started, and error details
    leave out errors.INTERNAL_METADATA_KEYS. Every stage sends the trace id in its initial
    metadata (so a cancelled stream still has it) and again in the trailers.

    Drain (``begin_drain``, ``drained``, ``cut``): new calls get UNAVAILABLE SHUTTING_DOWN with a
    retry hint; calls in flight run on (each ends by its own deadline at the latest) until the
    stage's grace period is over; those still running then are ended with the same status, never
    a bare "Cancelling all calls".
    """

    def __init__(self, service: str, *, mesh_token: str | None = None,
                 authenticate: Callable[[Sequence[tuple[str, str | bytes]], str], str] | None = None,
                 is_ready: Callable[[], bool] = lambda: True):
        self.service = service
        self.mesh_token = mesh_token
        self.authenticate = authenticate
        self.is_ready = is_ready
        self.public = authenticate is not None
        self.inflight = 0  # application calls being served (health watches excluded)
        self.draining = False
        self._calls: set[asyncio.Task] = set()  # the tasks serving those calls
        self._cut: set[asyncio.Task] = set()    # the ones the drain is ending
        self._idle = asyncio.Event()
        m = metrics.metrics_for(service)
        self.requests = m.counter("keel_requests_total")
        self.duration = m.histogram("keel_request_duration_seconds")
        self._wrapped: dict[str, tuple] = {}  # method -> (its handler, that handler wrapped)

    async def intercept_service(self, continuation, details):
        # grpc.aio runs this for every call; the wrapped handler is made once per method (and
        # again only if the servicer's handler for it changes).
        handler = await continuation(details)
        if handler is None or details.method.startswith(_EXEMPT):
            return handler
        known = self._wrapped.get(details.method)
        if known is None or known[0] is not handler:
            known = (handler, self._wrap(details.method, handler))
            self._wrapped[details.method] = known
        return known[1]

    def _wrap(self, method: str, handler):
        """``handler`` inside ``_scope``, with the request parsed tolerantly."""
        names = _MethodNames(self, method)
        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary(request, context):
                async with self._scope(names, request, context):
                    return await behavior(request, context)
            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream:
            stream = handler.unary_stream

            async def unary_stream(request, context):
                async with self._scope(names, request, context):
                    async for item in stream(request, context):
                        yield item
            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_stream:
            bidi = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async with self._scope(names, None, context):
                    async for item in bidi(_parsed(request_iterator), context):
                        yield item
            return grpc.stream_stream_rpc_method_handler(
                stream_stream, request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler

    def _admit(self, pairs: tuple, md: Mapping[str, str], request, context) -> None:
        if self.mesh_token is not None:
            meshauth.check(self.mesh_token, md)
        elif self.authenticate is not None:
            # Every metadata pair (a repeated header must stay visible) and the caller's address.
            self.authenticate(pairs, context.peer())
        if self.draining:
            raise self._shutting_down("is shutting down; send the call to another replica")
        if not self.is_ready():
            raise errors.NotReady(f"{self.service} is not serving yet (warming up)",
                                  reason="NOT_SERVING", retry_after_ms=NOT_SERVING_RETRY_MS)
        _check_parsed(request)

    def _parent(self, md: Mapping[str, str]):
        """The caller's trace context; a public stage logs and drops an invalid ``traceparent``."""
        if "traceparent" not in md:  # nothing to join (tracestate alone means nothing): a new trace
            return None
        parent = tracing.extract(md)
        if self.public and not trace.get_current_span(parent).get_span_context().is_valid:
            log.warning("ignoring an invalid traceparent; starting a new trace",
                        extra={"traceparent": md["traceparent"][:128]})
            return None
        return parent

    def _shutting_down(self, what: str) -> errors.NotReady:
        return errors.NotReady(f"{self.service} {what}", reason=errors.SHUTTING_DOWN,
                               retry_after_ms=NOT_SERVING_RETRY_MS)

    def begin_drain(self) -> None:
        self.draining = True

    async def drained(self, grace_s: float) -> bool:
        """Wait until no application call is in flight (True) or ``grace_s`` passes (False)."""
        if self.inflight:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except TimeoutError:
                pass
        return not self.inflight

    async def cut(self) -> None:
        """End every call still in flight with UNAVAILABLE SHUTTING_DOWN and a retry hint."""
        self._cut = set(self._calls)
        for task in self._cut:
            task.cancel()
        if self._cut:
            await asyncio.wait(self._cut, timeout=CUT_WAIT_S)

    @contextlib.asynccontextmanager
    async def _scope(self, names: _MethodNames, request, context):
        self.inflight += 1
        task = asyncio.current_task()
        self._calls.add(task)
        pairs = context.invocation_metadata() or ()
        md = {k: v for k, v in pairs if isinstance(v, str)}
        parent = self._parent(md)
        start = time.perf_counter()
        code = "OK"
        with tracing.tracer().start_as_current_span(
                names.span, context=parent or _NEW_TRACE, kind=trace.SpanKind.SERVER) as span:
            trace_id = tracing.trace_id_of(span)
            tokens = (trace_id_var.set(trace_id), rpc_var.set(names.method))
            try:
                if trace_id:
                    await context.send_initial_metadata(((TRACE_ID_KEY, trace_id),))
                self._admit(pairs, md, request, context)
                yield
                context.set_trailing_metadata(((TRACE_ID_KEY, trace_id),))
            except errors.KeelError as err:
                code = err.code
                _record_error(span, err)
                log.log(logging.ERROR if code == "INTERNAL" else logging.INFO, "rpc failed",
                        extra={"code": code, "reason": err.reason, "detail": err.message, "metadata": err.metadata})
                await context.abort(*to_status(err, trace_id, public=self.public))
            except GeneratorExit:
                # A streaming call ended (cancelled, cut) while grpc was writing one of its messages:
                # grpc then closes the handler's generator at its yield instead of cancelling it.
                code = "CANCELLED"
                raise
            except asyncio.CancelledError:
                if task not in self._cut:
                    code = "CANCELLED"
                    raise
                err = self._shutting_down("is shutting down; the call was cut at the end of its drain")
                code = err.code
                _record_error(span, err)
                log.warning("rpc cut by the drain", extra={"code": code, "reason": err.reason})
                await context.abort(*to_status(err, trace_id, public=self.public))
            except grpc.aio.AbortError:
                code = "CANCELLED"
                raise
            except Exception as exc:
                code = "INTERNAL"
                log.exception("unexpected error (bug)")
                err = errors.Fatal(f"internal error in {self.service}: {type(exc).__name__}", reason="INTERNAL")
                _record_error(span, err)
                await context.abort(*to_status(err, trace_id, public=self.public))
            finally:
                self.inflight -= 1
                self._calls.discard(task)
                if not self.inflight:
                    self._idle.set()
                names.requests(code).inc()
                names.duration.observe(time.perf_counter() - start)
                _reset((trace_id_var, tokens[0]), (rpc_var, tokens[1]))


class _MethodNames:
    """What a method's calls share, made once: its span name and its metric series."""

    def __init__(self, interceptor: ServerInterceptor, method: str):
        name = method.rsplit("/", 1)[-1]
        self.method, self.span = method, f"{interceptor.service}/{name}"
        self._requests = {}
        self._counter = lambda code: interceptor.requests.labels(service=interceptor.service, method=name, code=code)
        self.duration = interceptor.duration.labels(service=interceptor.service, method=name)

    def requests(self, code: str):
        """The request counter of this method and ``code``."""
        child = self._requests.get(code)
        if child is None:
            child = self._requests[code] = self._counter(code)
        return child


def _reset(*pairs: tuple[contextvars.ContextVar, contextvars.Token]) -> None:
    """Restore the log context variables. A cancelled stream's handler generator may be closed
    by asyncio's async-generator finalizer, in a task of its own and so in another context,
    where the tokens do not apply (ValueError) and there is nothing of this call's to restore:
    raising there would only leave "Task exception was never retrieved" in the log."""
    for var, token in pairs:
        with contextlib.suppress(ValueError):
            var.reset(token)


def _record_error(span: trace.Span, err: errors.KeelError) -> None:
    span.set_attribute("rpc.grpc.status", err.code)
    span.set_attribute("error.reason", err.reason)
    for key, value in err.metadata.items():
        span.set_attribute(f"error.metadata.{key}", value)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{err.code} {err.reason}: {err.message}"))
