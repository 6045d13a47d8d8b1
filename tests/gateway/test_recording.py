"""Replay records from the gateway: one per answered request with every fact a replay needs,
handed off through a bounded queue that never blocks an answer."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from keel.common.v1 import common_pb2
from keel.feedback.v1 import feedback_pb2
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.recording import FeedbackForwarder, ReplayConfig, ReplayRecorder, to_record
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.routing import Decision
from services.gateway.values import Call, Done, Encoded, Served
from shared import errors, metrics
from testing.upstreams import FakeUpstreams, no_sleep


class FakeFeedbackStub:
    """Stands in for the feedback stage's stub: records what arrives; ``fail`` calls fail first."""

    def __init__(self, fail: int = 0, release: asyncio.Event | None = None):
        self.batches: list[list] = []
        self.submitted: list = []
        self.fail, self.release = fail, release

    async def Record(self, request, timeout, metadata):
        if self.release is not None:
            await self.release.wait()
        if self.fail:
            self.fail -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="down")
        self.batches.append(list(request.records))

    def SubmitStream(self, metadata):
        return FakeStreamCall(self.answer)

    async def answer(self, request):
        self.submitted += [(item.trace_id, sum(len(b) for b in self.batches)) for item in request.items]
        return feedback_pb2.SubmitStreamResponse(results=[
            feedback_pb2.SubmitResult(feedback_id=item.feedback_id, created=True) for item in request.items])


class FakeStreamCall:
    """A SubmitStream call: each message written is answered in order by ``answer(request)``."""

    def __init__(self, answer):
        self._answer = answer
        self._requests: asyncio.Queue = asyncio.Queue()

    async def write(self, request):
        self._requests.put_nowait(request)

    async def done_writing(self):
        self._requests.put_nowait(None)

    def cancel(self):
        self._requests.put_nowait(None)

    async def __aiter__(self):
        while (request := await self._requests.get()) is not None:
            yield await self._answer(request)


def dropped(reason: str) -> float:
    counter = metrics.metrics_for("gateway").counter("keel_replay_records_dropped_total")
    return counter.labels(reason=reason)._value.get()


def served(trace_id: str, route: Decision | None = None) -> Served:
    return Served(Ask(messages=(("user", "hi"),), max_tokens=8, temperature=0.7, top_p=0.9, top_k=40),
                  Encoded([1, 2, 3], False, 3, "fp", "v" * 64, "c" * 64),
                  Done("stop", 3, 2, 1234, {"format": "float32"}, route=route), [5, 6],
                  common_pb2.ValidationResult(passed=True, probes={"entropy_mean": 0.25}, verdicts=[
                      common_pb2.Verdict(plugin="p", passed=True, message="", blocking=False)]), trace_id)


@pytest.mark.asyncio
async def test_every_answer_becomes_one_record_with_the_seed_the_gateway_picked():
    stub = FakeFeedbackStub()
    recorder = ReplayRecorder(ReplayConfig(), lambda: stub)
    recorder.start()
    pipe = Pipeline(FakeUpstreams(), RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)),
                    Limits(max_context_tokens=2048),
                    rng=random.Random(7), on_served=recorder.served)
    answer = await pipe.generate(Ask(messages=(("user", "hello"),), max_tokens=8), Call(1e12, "t" * 32))
    await recorder.delivered("t" * 32, 5)
    await recorder.close()
    (rec,) = [r for b in stub.batches for r in b]
    assert rec.trace_id == "t" * 32 and list(rec.prompt_ids) == [1, 2, 3] and list(rec.output_ids) == [5, 6, 7]
    assert rec.sampling.HasField("seed") and rec.sampling.seed == answer.seed
    assert rec.messages[0].content == "hello" and rec.finish_reason == "stop"
    assert rec.validation.probes["entropy_mean"] == 0.5


def test_a_record_carries_sampling_engine_and_verdicts():
    rec = to_record(served("a" * 32), 123)
    assert rec.created_unix_ms == 123 and rec.input_fingerprint == "fp"
    assert (rec.vocab_sha256, rec.chat_template_sha256) == ("v" * 64, "c" * 64)
    s = rec.sampling
    assert (s.max_tokens, s.top_k, s.seed) == (8, 40, 1234)
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert dict(rec.engine) == {"format": "float32"}
    assert rec.validation.verdicts[0].plugin == "p" and rec.validation.probes["entropy_mean"] == 0.25
    assert not rec.HasField("route")                    # one replica: no routing decision


def test_a_record_carries_the_routing_decision():
    rec = to_record(served("a" * 32, Decision("10.0.0.7:50052", "prefix", 3, "prefix_affinity")), 123)
    assert rec.route == feedback_pb2.RouteDecision(replica="10.0.0.7:50052", policy="prefix_affinity",
                                                   reason="prefix", matched_blocks=3)


@pytest.mark.asyncio
async def test_a_full_queue_drops_the_record_without_blocking_the_answer():
    release = asyncio.Event()
    stub = FakeFeedbackStub(release=release)
    recorder = ReplayRecorder(ReplayConfig(queue_size=2, batch=1), lambda: stub)
    recorder.start()
    before = dropped("queue_full")
    for i in range(5):
        recorder.served(served(f"{i:032x}"))  # returns at once even though nothing is sent yet
    await asyncio.sleep(0)
    assert dropped("queue_full") - before >= 2
    release.set()
    await recorder.close()
    assert 0 < sum(len(b) for b in stub.batches) <= 3


@pytest.mark.asyncio
async def test_an_unreachable_feedback_stage_is_retried_then_counted_as_dropped():
    stub = FakeFeedbackStub(fail=10)
    recorder = ReplayRecorder(ReplayConfig(attempts=2), lambda: stub)
    recorder.start()
    before = dropped("unreachable")
    recorder.served(served("a" * 32))
    await recorder.delivered("a" * 32, 5)
    assert dropped("unreachable") - before == 1 and stub.batches == []
    stub.fail = 1
    recorder.served(served("b" * 32))
    await recorder.delivered("b" * 32, 5)
    assert [r.trace_id for b in stub.batches for r in b] == ["b" * 32]
    await recorder.close()


@pytest.mark.asyncio
async def test_feedback_waits_for_its_trace_record_to_leave_the_queue():
    release = asyncio.Event()
    stub = FakeFeedbackStub(release=release)
    recorder = ReplayRecorder(ReplayConfig(), lambda: stub)
    recorder.start()
    recorder.served(served("a" * 32))
    submit = asyncio.create_task(FeedbackForwarder(lambda: stub, recorder).submit(
        feedback_pb2.SubmitRequest(trace_id="a" * 32, feedback_id="x"), 5))
    await asyncio.sleep(0.05)
    assert not submit.done()
    release.set()
    await submit
    assert stub.submitted == [("a" * 32, 1)]  # the record was sent before the feedback
    await recorder.close()


@pytest.mark.asyncio
async def test_an_unreachable_feedback_stage_is_unavailable_with_a_retry_hint():
    class Down(FakeFeedbackStub):
        async def answer(self, request):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="connection refused")
    stub = Down()
    with pytest.raises(errors.NotReady) as exc:
        await FeedbackForwarder(lambda: stub, ReplayRecorder(ReplayConfig(), lambda: stub)).submit(
            feedback_pb2.SubmitRequest(trace_id="a" * 32, feedback_id="x"), 5)
    assert exc.value.retry_after_ms > 0
