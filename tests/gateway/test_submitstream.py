"""The gateway's SubmitStream client (services/gateway/submitstream.py) on a scripted call: answers
reach their own batches in order, a batch given up on does not shift the answers after it, a call
that ends fails its waiting batches with a retry hint and the next batch opens a new call, and an
old call is closed for writing while its last answers still arrive."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from keel.feedback.v1 import feedback_pb2
from services.gateway.submitstream import SubmitStream
from shared import errors


class ScriptedCall:
    """A SubmitStream call whose answers the test hands out: ``answer()`` answers the oldest
    unanswered message, ``end(exc)`` ends the call (None: OK)."""

    def __init__(self):
        self.written: list[feedback_pb2.SubmitStreamRequest] = []
        self.closed_for_writing = False
        self._answered = 0
        self._out: asyncio.Queue = asyncio.Queue()

    async def write(self, request):
        self.written.append(request)

    async def done_writing(self):
        self.closed_for_writing = True

    def cancel(self):
        self._out.put_nowait(asyncio.CancelledError())

    def answer(self) -> None:
        request = self.written[self._answered]
        self._answered += 1
        self._out.put_nowait(feedback_pb2.SubmitStreamResponse(results=[
            feedback_pb2.SubmitResult(feedback_id=i.feedback_id, created=True) for i in request.items]))

    def end(self, exc: BaseException | None = None) -> None:
        self._out.put_nowait(exc)

    async def __aiter__(self):
        while (item := await self._out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


class ScriptedStub:
    def __init__(self):
        self.calls: list[ScriptedCall] = []

    def SubmitStream(self, metadata):
        self.calls.append(ScriptedCall())
        return self.calls[-1]


def batch(*ids: str) -> feedback_pb2.SubmitStreamRequest:
    return feedback_pb2.SubmitStreamRequest(items=[feedback_pb2.SubmitRequest(feedback_id=i) for i in ids])


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def one_waiting() -> tuple[ScriptedStub, SubmitStream, asyncio.Task]:
    """A stream with one batch written and waiting for its answer."""
    stub = ScriptedStub()
    stream = SubmitStream(lambda: stub, max_age_s=60)
    waiting = asyncio.create_task(stream.send(batch("x"), 5))
    await settle()
    return stub, stream, waiting


@pytest.mark.asyncio
async def test_answers_reach_their_own_batches_and_a_batch_given_up_on_does_not_shift_the_rest():
    stub = ScriptedStub()
    stream = SubmitStream(lambda: stub, max_age_s=60)
    late = asyncio.create_task(stream.send(batch("late"), 0.05))
    first = asyncio.create_task(stream.send(batch("a", "b"), 5))
    second = asyncio.create_task(stream.send(batch("c"), 5))
    with pytest.raises(errors.DeadlineExpired):
        await late                                   # its caller gave up before any answer came
    [call] = stub.calls
    for _ in range(3):
        call.answer()
    assert [r.feedback_id for r in (await first).results] == ["a", "b"]
    assert [r.feedback_id for r in (await second).results] == ["c"]
    assert [[i.feedback_id for i in m.items] for m in call.written] == [["late"], ["a", "b"], ["c"]]
    await stream.close()


@pytest.mark.asyncio
async def test_a_call_that_ends_fails_its_waiting_batches_with_a_retry_hint_and_the_next_opens_a_new_call():
    stub = ScriptedStub()
    stream = SubmitStream(lambda: stub, max_age_s=60)
    waiting = [asyncio.create_task(stream.send(batch(f"x{i}"), 5)) for i in range(2)]
    await settle()
    stub.calls[0].end(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="connection reset"))
    for task in waiting:
        with pytest.raises(errors.NotReady) as exc:
            await task
        assert exc.value.retry_after_ms > 0
    after = asyncio.create_task(stream.send(batch("y"), 5))
    await settle()
    assert len(stub.calls) == 2
    stub.calls[1].answer()
    assert [r.feedback_id for r in (await after).results] == ["y"]
    await stream.close()


@pytest.mark.asyncio
async def test_a_stream_the_stage_ends_without_an_error_fails_what_waits_with_a_retry_hint():
    stub, stream, waiting = await one_waiting()
    stub.calls[0].end()
    with pytest.raises(errors.NotReady) as exc:
        await waiting
    assert exc.value.reason == errors.SHUTTING_DOWN and exc.value.retry_after_ms > 0
    await stream.close()


@pytest.mark.asyncio
async def test_an_old_call_is_closed_for_writing_and_its_last_answers_still_arrive():
    stub = ScriptedStub()
    stream = SubmitStream(lambda: stub, max_age_s=0.05)
    old = asyncio.create_task(stream.send(batch("old"), 5))
    await asyncio.sleep(0.1)
    new = asyncio.create_task(stream.send(batch("new"), 5))
    await settle()
    assert len(stub.calls) == 2 and stub.calls[0].closed_for_writing and not stub.calls[1].closed_for_writing
    stub.calls[1].answer()
    stub.calls[0].answer()
    stub.calls[0].end()
    assert [r.feedback_id for r in (await old).results] == ["old"]
    assert [r.feedback_id for r in (await new).results] == ["new"]
    await stream.close()


@pytest.mark.asyncio
async def test_close_answers_the_waiting_batches_shutting_down():
    _, stream, waiting = await one_waiting()
    await stream.close()
    with pytest.raises(errors.NotReady) as exc:
        await waiting
    assert exc.value.reason == errors.SHUTTING_DOWN


@pytest.mark.asyncio
async def test_a_stream_the_transport_ends_with_internal_fails_what_waits_unavailable_with_a_retry_hint():
    stub, stream, waiting = await one_waiting()
    stub.calls[0].end(grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="Internal error from Core"))
    with pytest.raises(errors.NotReady) as exc:
        await waiting
    assert exc.value.code == "UNAVAILABLE" and exc.value.retry_after_ms > 0
    await stream.close()
