"""The coalesced SubmitFeedback batches on one long-lived SubmitStream call to the feedback stage.

A unary call per batch cost both processes a call's worth of work each time (a new HTTP/2 stream,
headers, the server interceptor, a span for the call) for a batch of one or two items at a steady
rate; on an open stream a batch is one message each way (``bench/bench_feedback.py`` measures
both). ``SubmitStream.send`` writes a batch as the next message of the open call and waits for the
answer at the same position: the feedback stage answers its messages in the order sent.

- Writes go one at a time (a call takes one pending write). A batch's future is queued before its
  write, so an answer that comes back before ``write`` returns finds it.
- When the call ends (the stage drained or crashed, the connection broke), every batch still
  waiting gets the call's error, UNAVAILABLE with a retry hint; the next batch opens a new call,
  on the next replica when there are several.
- A call older than ``max_age_s`` is closed for writing (its last answers still arrive) and the
  next batch opens a new one, so a gateway's batches move over the replicas.
- A batch whose caller's deadline passes raises DeadlineExpired; its answer, when it comes, is
  read and dropped, so the answers after it stay in step.
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Callable

import grpc

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from services.gateway.submits import no_answer
from shared import client, errors, meshauth

UNREACHABLE_RETRY_MS = 1000  # the hint when the feedback stage ended the call without one


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # an answer nobody waits for any more is not an "exception never retrieved"


class _Call:
    def __init__(self, call: grpc.aio.StreamStreamCall):
        self.call, self.opened = call, time.monotonic()
        self.waiting: collections.deque[asyncio.Future] = collections.deque()  # in the order written
        self.ended = False


class SubmitStream:
    def __init__(self, stub: Callable[[], feedback_pb2_grpc.FeedbackStub], *, max_age_s: float):
        self._stub, self._max_age = stub, max_age_s
        self._current: _Call | None = None
        self._writing = asyncio.Lock()
        self._readers: set[asyncio.Task] = set()

    async def send(self, request: feedback_pb2.SubmitStreamRequest,
                   timeout_s: float) -> feedback_pb2.SubmitStreamResponse:
        """The answer to ``request``; the call's error (a KeelError) when the call ended first."""
        answer: asyncio.Future[feedback_pb2.SubmitStreamResponse] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(_retrieved)
        async with self._writing:
            call = await self._call()
            call.waiting.append(answer)
            try:
                await call.call.write(request)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the call is over: its reader fails every waiting answer, this one included
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout_s)
        except TimeoutError:
            raise no_answer() from None

    async def _call(self) -> _Call:
        current = self._current
        if current is not None and not current.ended and time.monotonic() - current.opened < self._max_age:
            return current
        if current is not None and not current.ended:
            try:
                await current.call.done_writing()  # retired: its answers still come in; the next replica takes over
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # it ended meanwhile: its reader answered its batches
        # Its own metadata only: the call outlives the batch that opened it, so no trace context.
        call = _Call(self._stub().SubmitStream(metadata=tuple(meshauth.outgoing())))
        reader = asyncio.create_task(self._read(call), context=contextvars.Context())
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        self._current = call
        return call

    async def _read(self, c: _Call) -> None:
        err: errors.KeelError = errors.NotReady("the feedback stage ended the stream", reason=errors.SHUTTING_DOWN,
                                                retry_after_ms=UNREACHABLE_RETRY_MS)
        try:
            async for response in c.call:
                answer = c.waiting.popleft()
                if not answer.done():
                    answer.set_result(response)
        except grpc.aio.AioRpcError as exc:
            err = client.translate(exc)
            if "grpc-status-details-bin" not in dict(exc.trailing_metadata() or ()):
                # No status from the stage: the transport ended the call (the stage died or
                # restarted, the connection broke; grpc may call that INTERNAL). Worth a retry.
                err = errors.NotReady(f"the feedback stream broke: {exc.details()}", reason=errors.CONNECTION_LOST,
                                      retry_after_ms=UNREACHABLE_RETRY_MS)
            elif isinstance(err, errors.NotReady) and err.retry_after_ms is None:
                err.retry_after_ms = UNREACHABLE_RETRY_MS  # the stage itself is unreachable: worth a retry
        except asyncio.CancelledError:
            err = errors.NotReady("the gateway is shutting down", reason=errors.SHUTTING_DOWN,
                                  retry_after_ms=UNREACHABLE_RETRY_MS)
            raise
        finally:
            c.ended = True
            while c.waiting:  # each waiting batch gets its own copy of the call's error
                answer = c.waiting.popleft()
                if not answer.done():
                    answer.set_exception(client.error_from(err.code, err.message, reason=err.reason,
                                                           metadata=err.metadata, retry_after_ms=err.retry_after_ms))

    async def close(self) -> None:
        """End the open call (its waiting batches get UNAVAILABLE SHUTTING_DOWN) and stop reading."""
        if self._current is not None:
            self._current.call.cancel()
        for reader in list(self._readers):
            reader.cancel()
        if self._readers:
            await asyncio.wait(self._readers)
