"""Group commit of SubmitFeedback: the batcher's contract on a fake write (unit), then the feedback
stage as a real process on SQLite and on a real PostgreSQL: concurrent submits share
transactions, keep their per-item answers, and every acknowledged item survives a kill -9."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keelctl import health
from services.feedback.batcher import SubmitBatcher
from services.feedback.records import Feedback
from services.feedback.store import open_store
from shared import client, errors
from testing.ports import free_port
from tests.feedback.test_stage import replay_record

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "feedback-batch-token"
MD = (("x-keel-mesh-token", TOKEN),)
TRACE = "a" * 32


def fb(feedback_id: str, trace_id: str = TRACE, **kw) -> Feedback:
    return Feedback(trace_id=trace_id, feedback_id=feedback_id, error_type=kw.get("error_type", "fact_error"),
                    severity=kw.get("severity", "severe"))


class FakeWrite:
    """Records the batches it is given; blocks the first one until released, so that later
    submits queue up behind it."""

    def __init__(self, fail: Exception | None = None):
        self.batches: list[list[str]] = []
        self.release = asyncio.Event()
        self.fail = fail

    async def __call__(self, items):
        self.batches.append([i.feedback_id for i in items])
        if len(self.batches) == 1:
            await asyncio.wait_for(self.release.wait(), 10)
        if self.fail is not None:
            raise self.fail
        return [errors.NotFound("unknown", reason="TRACE_NOT_FOUND") if i.trace_id != TRACE else True
                for i in items]


@pytest.mark.asyncio
async def test_submits_queued_behind_a_commit_share_the_next_one_and_keep_their_own_answers():
    write = FakeWrite()
    batcher = SubmitBatcher(write, max_batch=100, queue_size=100)
    batcher.start()
    first = asyncio.create_task(batcher.submit(fb("first")))
    while not write.batches:
        await asyncio.sleep(0.01)
    rest = [asyncio.create_task(batcher.submit(fb(f"x{i}", trace_id=TRACE if i % 2 == 0 else "b" * 32)))
            for i in range(10)]
    await asyncio.sleep(0.05)
    write.release.set()
    assert await first is True
    results = await asyncio.gather(*rest, return_exceptions=True)
    assert write.batches == [["first"], [f"x{i}" for i in range(10)]]   # one commit for the ten
    assert [r is True for r in results] == [i % 2 == 0 for i in range(10)]
    assert all(isinstance(r, errors.NotFound) for r in results[1::2])
    await batcher.close()


@pytest.mark.asyncio
async def test_a_failed_write_fails_every_call_of_its_batch_with_a_retry_hint_and_later_ones_still_run():
    write = FakeWrite(fail=errors.NotReady("down", reason="DATABASE_UNAVAILABLE", retry_after_ms=1000))
    write.release.set()
    batcher = SubmitBatcher(write, max_batch=4, queue_size=100)
    batcher.start()
    results = await asyncio.gather(*(batcher.submit(fb(f"x{i}")) for i in range(10)), return_exceptions=True)
    assert all(isinstance(r, errors.NotReady) and r.retry_after_ms == 1000 for r in results)
    assert max(len(b) for b in write.batches) <= 4
    write.fail = RuntimeError("a bug")
    with pytest.raises(errors.NotReady):     # an unexpected error is a clear status, and the batcher lives on
        await batcher.submit(fb("after"))
    write.fail = None
    assert await batcher.submit(fb("later")) is True
    await batcher.close()


@pytest.mark.asyncio
async def test_a_malformed_item_is_refused_before_it_is_queued():
    write = FakeWrite()
    batcher = SubmitBatcher(write, max_batch=4, queue_size=1)
    with pytest.raises(errors.InvalidInput):      # not started: nothing would ever answer a queued item
        await batcher.submit(fb(" "))
    assert write.batches == []


@pytest.mark.asyncio
async def test_a_caller_that_gave_up_while_queued_is_left_out_and_close_answers_the_rest():
    write = FakeWrite()
    batcher = SubmitBatcher(write, max_batch=100, queue_size=100)
    batcher.start()
    first = asyncio.create_task(batcher.submit(fb("first")))
    while not write.batches:
        await asyncio.sleep(0.01)
    gave_up = asyncio.create_task(batcher.submit(fb("gave-up")))
    kept = asyncio.create_task(batcher.submit(fb("kept")))
    await asyncio.sleep(0.05)
    gave_up.cancel()
    write.release.set()
    assert await first is True and await kept is True
    assert write.batches == [["first"], ["kept"]]
    write.release.clear()
    write.batches.clear()
    blocked = asyncio.create_task(batcher.submit(fb("in-flight")))
    while not write.batches:
        await asyncio.sleep(0.01)
    queued = asyncio.create_task(batcher.submit(fb("queued")))
    await asyncio.sleep(0.05)
    await batcher.close()
    with pytest.raises(errors.NotReady) as info:
        await queued
    assert info.value.reason == errors.SHUTTING_DOWN
    write.release.set()
    blocked.cancel()


@pytest.mark.asyncio
async def test_submit_many_answers_each_item_in_order_and_a_malformed_one_alone_without_queueing_it():
    write = FakeWrite()
    write.release.set()
    batcher = SubmitBatcher(write, max_batch=100, queue_size=100)
    batcher.start()
    results = await batcher.submit_many([fb("a"), fb(""), fb("b", trace_id="b" * 32), fb("a", severity="minor")])
    assert results[0] is True and results[3] is True
    assert isinstance(results[1], errors.InvalidInput) and results[1].metadata == {"field": "feedback_id"}
    assert isinstance(results[2], errors.NotFound) and results[2].reason == "TRACE_NOT_FOUND"
    assert [i for b in write.batches for i in b] == ["a", "b", "a"]   # in order; the bad one never queued
    await batcher.close()


@pytest.fixture
def stage_on(db_url, tmp_path):
    """The feedback stage as a process on ``db_url``; yields (target, start) where start() (re)starts it."""
    port = free_port()
    env = dict(os.environ, KEEL_MESH_TOKEN=TOKEN, KEEL_VAR_DIR=str(tmp_path / "var"),
               KEEL_TRACES_DIR=str(tmp_path / "traces"), KEEL_FEEDBACK_SERVER__PORT=str(port),
               KEEL_FEEDBACK_SERVER__METRICS_PORT="0", KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT="0",
               KEEL_FEEDBACK_DATABASE__URL=db_url)
    target, procs = f"127.0.0.1:{port}", []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "services.feedback"], cwd=ROOT, env=env,
                                stdout=open(tmp_path / f"feedback-{len(procs)}.log", "wb"), stderr=subprocess.STDOUT)
        procs.append(proc)
        health.wait_serving({"feedback": (target, "keel.feedback.v1.Feedback")}, 60, lambda: proc.poll() is None)
        return proc

    yield target, start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def request(feedback_id: str, trace_id: str = TRACE, severity: str = "severe") -> feedback_pb2.SubmitRequest:
    return feedback_pb2.SubmitRequest(trace_id=trace_id, feedback_id=feedback_id, error_type="fact_error",
                                      severity=severity, expected_keywords=["Paris"])


@pytest.mark.slow
def test_concurrent_submits_get_their_own_answers_and_every_acknowledged_one_survives_kill_9(stage_on, db_url):
    target, start = stage_on
    proc = start()
    acked: list[str] = []

    async def load() -> list:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = feedback_pb2_grpc.FeedbackStub(ch)
            record = replay_record(TRACE)
            record.created_unix_ms = int(time.time() * 1000)   # not purged by retention at the restart
            await stub.Record(feedback_pb2.RecordRequest(records=[record]), metadata=MD)

            async def one(i: int):
                trace = TRACE if i % 5 else "c" * 32           # every fifth names an unknown trace
                try:
                    resp = await stub.Submit(request(f"fb-{i % 40}", trace, "minor" if i >= 40 else "severe"),
                                             metadata=MD, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return client.translate(exc)
                acked.append(f"fb-{i % 40}")
                return resp.created
            first = await asyncio.gather(*(one(i) for i in range(40)))
            second = await asyncio.gather(*(one(i) for i in range(40, 80)))   # the same ids again: updates

            async def flood(w: int):
                i = 0
                while True:
                    await stub.Submit(request(f"crash-{w}-{i}"), metadata=MD, timeout=30)
                    acked.append(f"crash-{w}-{i}")
                    i += 1
            tasks = [asyncio.create_task(flood(w)) for w in range(8)]
            while sum(1 for a in acked if a.startswith("crash-")) < 200:
                await asyncio.sleep(0.01)
            proc.send_signal(signal.SIGKILL)                   # mid-load: batches are being committed
            done = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(d, grpc.aio.AioRpcError) for d in done)
            return first + second

    answers = asyncio.run(load())
    proc.wait(10)
    assert [a for i, a in enumerate(answers[:40]) if i % 5] == [True] * 32
    assert all(getattr(a, "reason", None) == "TRACE_NOT_FOUND" for a in answers[0:80:5])
    assert [a for i, a in enumerate(answers[40:]) if i % 5] == [False] * 32    # updated, never duplicated
    store = open_store(db_url)
    rows = {r["feedback_id"]: r for r in store.list_feedback()}
    assert set(acked) <= set(rows)                     # every acknowledged item is in the database
    assert all(rows[f"fb-{i}"]["severity"] == "minor" for i in range(40) if i % 5)
    assert not any(r["trace_id"] == "c" * 32 for r in rows.values())
    start()                                            # and the stage comes back on the same database
    with grpc.insecure_channel(target) as ch:
        assert feedback_pb2_grpc.FeedbackStub(ch).Submit(request("fb-1"), metadata=MD).created is False


@pytest.mark.slow
def test_submit_batch_answers_each_item_after_its_commit_and_a_bad_item_fails_alone(stage_on, db_url):
    target, start = stage_on
    start()
    with grpc.insecure_channel(target) as ch:
        stub = feedback_pb2_grpc.FeedbackStub(ch)
        stub.Record(feedback_pb2.RecordRequest(records=[replay_record(TRACE)]), metadata=MD)
        bad_enum = request("bad-enum")
        bad_enum.error_type = "typo"
        nul = request("nul")
        nul.comment = "a\x00b"  # PostgreSQL's text cannot hold it: refused here, not failing the batch's write
        items = [request("ok-1"), request(""), request("ok-2", "c" * 32), bad_enum, nul,
                 request("ok-1", severity="minor")]
        results = stub.SubmitBatch(feedback_pb2.SubmitBatchRequest(items=items), metadata=MD, timeout=30).results
        rows = {r["feedback_id"]: r for r in open_store(db_url).list_feedback()}   # read after the answer
    assert [r.feedback_id for r in results] == ["ok-1", "", "ok-2", "bad-enum", "nul", "ok-1"]
    assert [r.HasField("error") for r in results] == [False, True, True, True, True, False]
    assert results[0].created and not results[5].created            # the repeated id updated its item
    assert (results[1].error.code, results[1].error.reason, dict(results[1].error.metadata)) == (
        "INVALID_ARGUMENT", "INVALID_FEEDBACK_FIELD", {"field": "feedback_id"})
    assert (results[2].error.code, results[2].error.reason) == ("NOT_FOUND", "TRACE_NOT_FOUND")
    assert dict(results[3].error.metadata) == {"field": "error_type"} and "typo" in results[3].error.message
    assert (results[4].error.code, dict(results[4].error.metadata)) == ("INVALID_ARGUMENT", {"field": "comment"})
    assert not any(r.error.HasField("retry_after_ms") for r in results[1:5])
    assert set(rows) == {"ok-1"} and rows["ok-1"]["severity"] == "minor"


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_submit_stream_answers_each_message_in_order_and_a_draining_stage_ends_it_with_a_retry_hint(stage_on, db_url):
    target, start = stage_on
    proc = start()

    async def run() -> tuple[list, errors.KeelError, float]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = feedback_pb2_grpc.FeedbackStub(ch)
            await stub.Record(feedback_pb2.RecordRequest(records=[replay_record(TRACE)]), metadata=MD)
            call = stub.SubmitStream(metadata=MD)
            # Three messages written before any answer is read: they are answered in the order sent.
            for batch in ([request("s-1"), request("s-2", "c" * 32)], [request("s-1", severity="minor")],
                          [request("")]):
                await call.write(feedback_pb2.SubmitStreamRequest(items=batch))
            answers = [await call.read() for _ in range(3)]
            proc.send_signal(signal.SIGTERM)  # drain: the stream ends long before the 10 s grace
            t0 = time.monotonic()
            try:
                while True:
                    await call.read()
            except grpc.aio.AioRpcError as exc:
                return answers, client.translate(exc), time.monotonic() - t0
    answers, ended, took = asyncio.run(run())
    assert [[r.feedback_id for r in a.results] for a in answers] == [["s-1", "s-2"], ["s-1"], [""]]
    assert answers[0].results[0].created and not answers[1].results[0].created   # the second updated the first
    assert answers[0].results[1].error.reason == "TRACE_NOT_FOUND"
    assert answers[2].results[0].error.reason == "INVALID_FEEDBACK_FIELD"
    assert isinstance(ended, errors.NotReady) and ended.reason == errors.SHUTTING_DOWN and ended.retry_after_ms
    assert took < 5
    proc.wait(30)
    assert {r["feedback_id"]: r["severity"] for r in open_store(db_url).list_feedback()} == {"s-1": "minor"}
