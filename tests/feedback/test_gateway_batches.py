"""SubmitFeedback through a real gateway process to a real feedback stage process (SQLite and a real
PostgreSQL): the gateway sends concurrent calls on as shared batches of its SubmitStream call, every caller gets
its own status with its own ErrorInfo reason, and a feedback stage killed mid-load answers the
calls in flight UNAVAILABLE with a retry hint while every acknowledged item is in the database."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl import health
from keelctl.ask import DEV_API_KEY
from services.feedback.store import open_store
from shared import client, errors
from testing.mesh import wait_until
from testing.ports import free_port
from tests.feedback.test_stage import replay_record

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "gateway-batch-token"
API = (("x-api-key", DEV_API_KEY),)
TRACE = "a" * 32


class Pair:
    """A feedback stage (restartable on its port) and a gateway whose only upstream that answers is it."""

    def __init__(self, tmp: Path, db_url: str):
        self.tmp, self.feedback, self.gateway = tmp, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        dead = lambda: f"[127.0.0.1:{free_port()}]"  # noqa: E731 - stages this test does not need
        self.env = dict(os.environ, KEEL_MESH_TOKEN=TOKEN, KEEL_VAR_DIR=str(tmp / "var"),
                        KEEL_TRACES_DIR=str(tmp / "traces"), KEEL_FEEDBACK_DATABASE__URL=db_url,
                        KEEL_FEEDBACK_SERVER__PORT=self.feedback.rsplit(":", 1)[1],
                        KEEL_FEEDBACK_SERVER__METRICS_PORT="0", KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT=str(free_port()),
                        KEEL_GATEWAY_SERVER__PORT=self.gateway.rsplit(":", 1)[1], KEEL_GATEWAY_SERVER__METRICS_PORT="0",
                        KEEL_GATEWAY_UPSTREAMS__FEEDBACK=f"[{self.feedback}]", KEEL_GATEWAY_UPSTREAMS__TOKENIZER=dead(),
                        KEEL_GATEWAY_UPSTREAMS__INFERENCE=dead(), KEEL_GATEWAY_UPSTREAMS__VALIDATOR=dead(),
                        KEEL_GATEWAY_RATE_LIMITS__DEFAULT="{rate_per_s: 100000, burst: 100000}")
        self.procs: list[subprocess.Popen] = []

    def start(self, stage: str) -> subprocess.Popen:
        log = open(self.tmp / f"{stage}-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", f"services.{stage}"], cwd=ROOT, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        target = self.feedback if stage == "feedback" else self.gateway
        health.wait_serving({stage: (target, f"keel.{stage}.v1.{stage.capitalize()}")}, 60, lambda: proc.poll() is None)
        return proc

    def spans(self, name: str) -> list[dict]:
        out = []
        for path in (self.tmp / "traces").glob("*.jsonl"):
            out += [s for s in map(json.loads, path.read_text().splitlines()) if s["name"] == name]
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


@pytest.fixture
def pair(db_url, tmp_path):
    p = Pair(tmp_path, db_url)
    feedback = p.start("feedback")
    with grpc.insecure_channel(p.feedback) as ch:
        record = replay_record(TRACE)
        record.created_unix_ms = int(time.time() * 1000)   # not purged by retention at a restart
        feedback_pb2_grpc.FeedbackStub(ch).Record(feedback_pb2.RecordRequest(records=[record]),
                                                  metadata=(("x-keel-mesh-token", TOKEN),))
    p.start("gateway")
    yield p, feedback
    p.stop()


def item(feedback_id: str, trace_id: str = TRACE, **kw) -> gateway_pb2.SubmitFeedbackRequest:
    values = {"error_type": "fact_error", "severity": "severe", "expected_keywords": ["Paris"]}
    values.update(kw)
    return gateway_pb2.SubmitFeedbackRequest(trace_id=trace_id, feedback_id=feedback_id, **values)


async def answer(stub, request) -> object:
    try:
        return await stub.SubmitFeedback(request, metadata=API, timeout=30)
    except grpc.aio.AioRpcError as exc:
        return client.translate(exc)


def test_concurrent_calls_share_batches_and_each_gets_its_own_status_and_reason(pair, db_url):
    p, _ = pair
    requests = []
    for i in range(60):
        kind = i % 6
        requests.append(item(f"fb-{i}") if kind < 3 else
                        item(f"fb-{i}", trace_id="c" * 32) if kind == 3 else
                        item("") if kind == 4 else item(f"fb-{i}", severity="fatal"))

    async def load():
        async with grpc.aio.insecure_channel(p.gateway) as ch:
            return await asyncio.gather(*(answer(gateway_pb2_grpc.GatewayStub(ch), r) for r in requests))
    answers = asyncio.run(load())
    for i, a in enumerate(answers):
        kind = i % 6
        if kind < 3:
            assert isinstance(a, gateway_pb2.SubmitFeedbackResponse) and a.created and a.feedback_id == f"fb-{i}"
        elif kind == 3:
            assert (a.code, a.reason) == ("NOT_FOUND", "TRACE_NOT_FOUND")
        else:
            assert (a.code, a.reason) == ("INVALID_ARGUMENT", "INVALID_FEEDBACK_FIELD")
            assert a.metadata["field"] == ("feedback_id" if kind == 4 else "severity")
    stored = {r["feedback_id"] for r in open_store(db_url).list_feedback()}
    assert stored == {f"fb-{i}" for i in range(60) if i % 6 < 3}
    wait_until(lambda: len(p.spans("gateway/SubmitBatch")) >= 1 and len(p.spans("gateway/SubmitFeedback")) >= 60
               and len(p.spans("feedback/SubmitStream.batch")) >= len(p.spans("gateway/SubmitBatch")),
               30, "spans written")
    batches = p.spans("gateway/SubmitBatch")
    assert sum(s["attributes"]["items"] for s in batches) == 60
    assert len(batches) < 60                                          # in fewer messages than items
    # The feedback stage's span of each batch is a child of the gateway's, in the same trace.
    received = {(s["trace_id"], s["parent_id"]): s["attributes"]["items"]
                for s in p.spans("feedback/SubmitStream.batch")}
    assert {(s["trace_id"], s["span_id"]): s["attributes"]["items"] for s in batches} == received


def test_a_feedback_stage_killed_mid_load_answers_unavailable_with_a_hint_and_loses_no_acknowledged_item(
        pair, db_url):
    p, feedback = pair
    acked: set[str] = set()
    failed: list[errors.KeelError] = []
    restarted = asyncio.Event()

    async def load():
        async with grpc.aio.insecure_channel(p.gateway) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)

            async def worker(w: int):
                i = 0
                while not restarted.is_set() or sum(1 for a in acked if a.endswith("-after")) < 50:
                    fid = f"w{w}-{i}" + ("-after" if restarted.is_set() else "")
                    a = await answer(stub, item(fid))
                    if isinstance(a, errors.KeelError):
                        failed.append(a)
                        await asyncio.sleep(0.05)
                    else:
                        acked.add(fid)
                    i += 1
            workers = [asyncio.create_task(worker(w)) for w in range(8)]
            while len(acked) < 200:
                await asyncio.sleep(0.01)
            feedback.send_signal(signal.SIGKILL)     # mid-load: batches are on the wire and committing
            feedback.wait(10)
            while not failed:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(p.start, "feedback")
            restarted.set()
            await asyncio.wait_for(asyncio.gather(*workers), 120)
    asyncio.run(load())
    assert failed and all(isinstance(e, errors.NotReady) and e.retry_after_ms for e in failed)
    stored = {r["feedback_id"] for r in open_store(db_url).list_feedback()}
    assert acked <= stored                           # every acknowledged item is in the database
    assert sum(1 for a in acked if a.endswith("-after")) >= 50    # and the gateway goes on after the restart
