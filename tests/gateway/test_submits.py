"""The gateway's SubmitFeedback coalescing (services/gateway/submits.py) on a scripted send: calls
that arrive while a batch is on the wire share the next SubmitBatch, each caller gets its own
item's result or error, and a failed or broken batch answers every caller instead of hanging."""
from __future__ import annotations

import asyncio

import pytest

from keel.feedback.v1 import feedback_pb2
from services.gateway.submits import SubmitCoalescer
from shared import errors

UNKNOWN = "f" * 32


class ScriptedSend:
    """Answers each SubmitBatch: an item naming UNKNOWN gets NOT_FOUND TRACE_NOT_FOUND, the rest
    are created. ``gate`` (when set) holds every batch until it is released; ``fail`` raises."""

    def __init__(self, gate: asyncio.Event | None = None):
        self.batches: list[list[str]] = []
        self.timeouts: list[float] = []
        self.gate, self.fail = gate, None

    async def __call__(self, request: feedback_pb2.SubmitStreamRequest, timeout: float):
        self.batches.append([i.feedback_id for i in request.items])
        self.timeouts.append(timeout)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return feedback_pb2.SubmitStreamResponse(results=[
            feedback_pb2.SubmitResult(feedback_id=i.feedback_id, error=feedback_pb2.SubmitItemError(
                code="NOT_FOUND", reason="TRACE_NOT_FOUND", message="no such trace",
                metadata={"trace_id": i.trace_id}))
            if i.trace_id == UNKNOWN else feedback_pb2.SubmitResult(feedback_id=i.feedback_id, created=True)
            for i in request.items])


def item(feedback_id: str, trace_id: str = "a" * 32) -> feedback_pb2.SubmitRequest:
    return feedback_pb2.SubmitRequest(trace_id=trace_id, feedback_id=feedback_id, error_type="fact_error",
                                      severity="severe")


async def until(pred) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.mark.asyncio
async def test_calls_during_a_batch_share_the_next_one_and_a_bad_item_fails_alone_with_its_reason():
    gate = asyncio.Event()
    send = ScriptedSend(gate)
    co = SubmitCoalescer(send, max_batch=64, max_inflight=1)
    first = asyncio.create_task(co.submit(item("first"), 10))
    await until(lambda: send.batches)
    assert send.batches == [["first"]]            # a lone item goes at once: no timer to wait for
    rest = [asyncio.create_task(co.submit(item(f"x{i}", UNKNOWN if i == 3 else "a" * 32), 10)) for i in range(6)]
    await asyncio.sleep(0.05)
    assert len(send.batches) == 1                 # nothing else on the wire while the first is
    gate.set()
    assert (await first).created
    results = await asyncio.gather(*rest, return_exceptions=True)
    assert send.batches == [["first"], [f"x{i}" for i in range(6)]]
    assert [r.feedback_id for i, r in enumerate(results) if i != 3] == ["x0", "x1", "x2", "x4", "x5"]
    bad = results[3]
    assert isinstance(bad, errors.NotFound) and bad.reason == "TRACE_NOT_FOUND"
    assert bad.metadata == {"trace_id": UNKNOWN} and bad.retry_after_ms is None
    await co.close()


@pytest.mark.asyncio
async def test_a_batch_is_at_most_max_batch_items_and_its_deadline_is_its_latest_callers():
    gate = asyncio.Event()
    send = ScriptedSend(gate)
    co = SubmitCoalescer(send, max_batch=3, max_inflight=1)
    calls = [asyncio.create_task(co.submit(item(f"x{i}"), 5 if i < 4 else 30)) for i in range(7)]
    await until(lambda: send.batches)
    gate.set()
    await asyncio.gather(*calls)
    assert send.batches == [["x0", "x1", "x2"], ["x3", "x4", "x5"], ["x6"]]
    assert send.timeouts[0] <= 5 < send.timeouts[1] <= 30
    await co.close()


@pytest.mark.asyncio
async def test_a_batch_that_fails_as_a_whole_answers_each_caller_with_the_error_and_its_retry_hint():
    send = ScriptedSend()
    send.fail = errors.NotReady("feedback stage restarting", reason=errors.SHUTTING_DOWN, retry_after_ms=1000)
    co = SubmitCoalescer(send, max_batch=64, max_inflight=1)
    results = await asyncio.gather(*(co.submit(item(f"x{i}"), 10) for i in range(5)), return_exceptions=True)
    assert all(isinstance(r, errors.NotReady) and r.reason == errors.SHUTTING_DOWN and r.retry_after_ms == 1000
               for r in results)
    assert len({id(r) for r in results}) == 5     # each caller raises its own error object
    send.fail = None
    assert (await co.submit(item("later"), 10)).created   # the coalescer goes on
    await co.close()


@pytest.mark.asyncio
async def test_a_broken_answer_is_an_internal_error_for_its_callers_never_a_hang():
    async def short(request, timeout):
        return feedback_pb2.SubmitStreamResponse()   # no results for the items
    co = SubmitCoalescer(short, max_batch=64, max_inflight=1)
    with pytest.raises(errors.Fatal):
        await asyncio.wait_for(co.submit(item("x"), 30), 5)
    await co.close()


@pytest.mark.asyncio
async def test_a_caller_that_gave_up_while_queued_is_left_out_and_a_slow_batch_is_deadline_exceeded():
    gate = asyncio.Event()
    send = ScriptedSend(gate)
    co = SubmitCoalescer(send, max_batch=64, max_inflight=1)
    first = asyncio.create_task(co.submit(item("first"), 10))
    await until(lambda: send.batches)
    gave_up = asyncio.create_task(co.submit(item("gave-up"), 10))
    kept = asyncio.create_task(co.submit(item("kept"), 10))
    await asyncio.sleep(0.05)
    gave_up.cancel()
    gate.set()
    await first, await kept
    assert send.batches == [["first"], ["kept"]]
    gate.clear()
    with pytest.raises(errors.DeadlineExpired):
        await co.submit(item("slow"), 0.1)
    gate.set()
    await co.close()
