"""The feedback stage as a real process (`python -m services.feedback`) on a real PostgreSQL:
record, submit, the statuses a client sees, and the database going away under it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from keel.common.v1 import common_pb2
from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keelctl import health
from services.feedback.store import open_store
from shared import client
from testing.mesh import wait_until
from testing.ports import free_port
from testing.postgres import PgServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "feedback-test-token"
MD = (("x-keel-mesh-token", TOKEN),)


@pytest.fixture
def stage(tmp_path):
    pg = PgServer().init()
    pg.start()
    port = free_port()
    env = dict(os.environ, KEEL_MESH_TOKEN=TOKEN, KEEL_VAR_DIR=str(tmp_path / "var"),
               KEEL_TRACES_DIR=str(tmp_path / "traces"), KEEL_FEEDBACK_SERVER__PORT=str(port),
               KEEL_FEEDBACK_SERVER__METRICS_PORT="0", KEEL_FEEDBACK_DATABASE__URL=pg.url,
               KEEL_FEEDBACK_DATABASE__CONNECT_TIMEOUT_S="1", KEEL_FEEDBACK_REPLAY__PROBE_INTERVAL_S="0.1",
               KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT="0")
    log = open(tmp_path / "feedback.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.feedback"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        health.wait_serving({"feedback": (target, "keel.feedback.v1.Feedback")}, 60, lambda: proc.poll() is None)
        with grpc.insecure_channel(target) as ch:
            yield feedback_pb2_grpc.FeedbackStub(ch), pg
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        pg.stop()


def replay_record(trace_id: str) -> feedback_pb2.ReplayRecord:
    return feedback_pb2.ReplayRecord(
        trace_id=trace_id, created_unix_ms=1_700_000_000_000, prompt_ids=[1, 2, 3], output_ids=[4, 5],
        messages=[common_pb2.ChatMessage(role="user", content="hi")], finish_reason="stop",
        sampling=common_pb2.SamplingParams(max_tokens=8, seed=7), engine={"format": "float32"})


def item(trace_id: str, **kw) -> feedback_pb2.SubmitRequest:
    values = {"feedback_id": "fb-1", "error_type": "fact_error", "severity": "severe",
              "expected_keywords": ["Paris"], "comment": "wrong capital"}
    values.update(kw)
    return feedback_pb2.SubmitRequest(trace_id=trace_id, **values)


def rpc_error(call) -> Exception:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return client.translate(exc.value)


def test_records_and_feedback_round_trip_with_clear_statuses(stage):
    stub, pg = stage
    assert stub.Record(feedback_pb2.RecordRequest(records=[replay_record("a" * 32)]), metadata=MD).stored == 1
    assert stub.Record(feedback_pb2.RecordRequest(records=[replay_record("a" * 32)]), metadata=MD).stored == 0
    assert stub.Submit(item("a" * 32), metadata=MD).created is True
    assert stub.Submit(item("a" * 32, severity="moderate"), metadata=MD).created is False
    rows = open_store(pg.url).list_feedback()
    assert [(r["feedback_id"], r["severity"]) for r in rows] == [("fb-1", "moderate")]

    err = rpc_error(lambda: stub.Submit(item("b" * 32), metadata=MD))
    assert err.code == "NOT_FOUND" and err.reason == "TRACE_NOT_FOUND"
    for field, bad in (("error_type", {"error_type": "typo"}), ("severity", {"severity": "meh"}),
                       ("feedback_id", {"feedback_id": ""})):
        err = rpc_error(lambda: stub.Submit(item("a" * 32, **bad), metadata=MD))
        assert err.code == "INVALID_ARGUMENT" and err.metadata["field"] == field, field
    err = rpc_error(lambda: stub.Submit(item("a" * 32)))
    assert err.code == "UNAUTHENTICATED"
    err = rpc_error(lambda: stub.Record(feedback_pb2.RecordRequest(records=[replay_record("not-a-trace")]),
                                        metadata=MD))
    assert err.code == "INVALID_ARGUMENT" and err.reason == "INVALID_REPLAY_RECORD"


def test_with_the_database_killed_submit_is_unavailable_and_records_arrive_once_it_is_back(stage):
    stub, pg = stage
    stub.Record(feedback_pb2.RecordRequest(records=[replay_record("a" * 32)]), metadata=MD)
    pg.kill()
    err = rpc_error(lambda: stub.Submit(item("a" * 32), metadata=MD))
    assert err.code == "UNAVAILABLE" and err.reason == "DATABASE_UNAVAILABLE"
    assert err.retry_after_ms and err.retry_after_ms > 0
    resp = stub.Record(feedback_pb2.RecordRequest(records=[replay_record("b" * 32)]), metadata=MD)
    assert (resp.stored, resp.spilled) == (0, 1)
    pg.start()
    store = open_store(pg.url)
    wait_until(lambda: len(store.list_records(0)) == 2, 30, "the spilled record in PostgreSQL")
    assert stub.Submit(item("b" * 32), metadata=MD).created is True


def test_a_bad_config_value_stops_the_stage_naming_the_field(tmp_path):
    env = dict(os.environ, KEEL_VAR_DIR=str(tmp_path), KEEL_FEEDBACK_REPLAY__RETENTION_DAYS="0")
    done = subprocess.run([sys.executable, "-m", "services.feedback"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "replay.retention_days" in done.stdout + done.stderr
