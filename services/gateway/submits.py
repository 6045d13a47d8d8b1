"""SubmitFeedback calls coalesced into batches for the feedback stage.

Forwarding each SubmitFeedback as a message of its own would cost both processes a message's
worth of CPU (the send, the read, a span) per item. ``SubmitCoalescer`` queues each item and sends
whatever is queued as one batch (a ``SubmitStreamRequest``, sent by ``send``: on the gateway, a
message of its SubmitStream call), at most ``max_batch`` items, with at most ``max_inflight``
batches on the wire at once. There is no timer: a lone item on an idle gateway
goes at once; under load the items that arrive while batches are in flight form the next one.

Each caller gets its own item's result: created/updated, or the item's own error (a bad field, an
unknown trace) raised as the KeelError the feedback stage named, so one bad item fails alone. A
batch call that fails as a whole (the feedback stage unreachable, restarting, its database down)
fails every item of that batch with the translated error, UNAVAILABLE with a retry hint. An item
is answered as stored only when the feedback stage says so, which it does after the commit; an
item answered with an error may or may not be stored, and sending it again is safe (a
feedback_id is created once, then updated). A caller that gives up while its item is still queued
here is left out of the next batch.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import trace

from keel.feedback.v1 import feedback_pb2
from shared import client, errors, tracing

log = logging.getLogger("keel.gateway")

Send = Callable[[feedback_pb2.SubmitStreamRequest, float], Awaitable[feedback_pb2.SubmitStreamResponse]]


@dataclass
class _Pending:
    item: feedback_pb2.SubmitRequest
    future: asyncio.Future
    deadline: float  # time.monotonic() by which its caller wants an answer
    caller: trace.SpanContext  # the caller's span: the batch's span links to it


def no_answer() -> errors.DeadlineExpired:
    """What a caller gets when the feedback stage did not answer within its deadline."""
    return errors.DeadlineExpired("the feedback stage did not answer within the call's deadline", retry_after_ms=1000)


def item_error(e: feedback_pb2.SubmitItemError) -> errors.KeelError:
    """The KeelError one item of a batch failed with (the feedback stage's SubmitItemError)."""
    return client.error_from(e.code, e.message, reason=e.reason, metadata=dict(e.metadata),
                             retry_after_ms=e.retry_after_ms if e.HasField("retry_after_ms") else None)


class SubmitCoalescer:
    def __init__(self, send: Send, *, max_batch: int, max_inflight: int):
        self._send, self._max = send, max_batch
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()  # bounded by the calls in flight
        self._slots = asyncio.Semaphore(max_inflight)
        self._task: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()

    async def submit(self, item: feedback_pb2.SubmitRequest, timeout_s: float) -> feedback_pb2.SubmitResult:
        """The item's result once the feedback stage answered its batch; its error raised."""
        if self._task is None:  # outside any caller's context: a batch belongs to no one caller's trace
            self._task = asyncio.create_task(self._run(), context=contextvars.Context())
        future: asyncio.Future[feedback_pb2.SubmitResult] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, future, time.monotonic() + timeout_s,
                                        trace.get_current_span().get_span_context()))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise no_answer() from None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sending:
            await asyncio.wait(self._sending)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            await self._slots.acquire()  # while every slot is busy, the queue gathers the next batch
            while len(batch) < self._max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [p for p in batch if not p.future.done()]  # callers that gave up are left out
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._deliver(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _deliver(self, batch: list[_Pending]) -> None:
        try:
            results = await self._results(batch)
        except errors.KeelError as err:  # the batch call failed as a whole: each item gets its own copy
            results = [client.error_from(err.code, err.message, reason=err.reason, metadata=err.metadata,
                                         retry_after_ms=err.retry_after_ms) for _ in batch]
        except Exception:  # noqa: BLE001 - a bug must not leave the callers waiting for their deadlines
            log.exception("feedback batch failed", extra={"items": len(batch)})
            results = [errors.Fatal("internal error forwarding feedback", reason="INTERNAL") for _ in batch]
        finally:
            self._slots.release()
        for p, result in zip(batch, results):
            if p.future.done():  # its caller gave up
                continue
            if isinstance(result, errors.KeelError):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)

    async def _results(self, batch: list[_Pending]) -> list[feedback_pb2.SubmitResult | errors.KeelError]:
        timeout = max(0.001, max(p.deadline for p in batch) - time.monotonic())
        # One span per batch, with an OpenTelemetry link to each caller's span; the batch carries
        # its context (the feedback stage's span for the batch is a child of it).
        with tracing.tracer().start_as_current_span(
                "gateway/SubmitBatch", kind=trace.SpanKind.CLIENT, attributes={"items": len(batch)},
                links=[trace.Link(p.caller) for p in batch if p.caller.is_valid]):
            request = feedback_pb2.SubmitStreamRequest(items=[p.item for p in batch],
                                                      traceparent=dict(tracing.inject()).get("traceparent", ""))
            response = await self._send(request, timeout)
        if len(response.results) != len(batch):
            raise RuntimeError(f"the feedback stage answered {len(response.results)} results for {len(batch)} items")
        return [item_error(r.error) if r.HasField("error") else r for r in response.results]
