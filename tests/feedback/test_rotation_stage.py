"""The feedback stage as a real process with rotation on: Alertmanager's webhook in, the rotation
RPCs out, with the statuses and reasons a caller sees (propose mode; the inference replica it would
switch is not running, so an approved switch fails after its tries and is recorded as failed)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keelctl import health
from shared import client
from testing.ports import free_port
from tests.feedback.test_rotation_webhook import payload

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "rotation-stage-token"
MD = (("x-keel-mesh-token", TOKEN),)


@pytest.fixture
def stage(tmp_path):
    port, hook = free_port(), free_port()
    env = dict(os.environ, KEEL_MESH_TOKEN=TOKEN, KEEL_VAR_DIR=str(tmp_path / "var"),
               KEEL_TRACES_DIR=str(tmp_path / "traces"), KEEL_FEEDBACK_SERVER__PORT=str(port),
               KEEL_FEEDBACK_SERVER__METRICS_PORT="0", KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT=str(hook),
               KEEL_FEEDBACK_ROTATION__MODE="propose", KEEL_FEEDBACK_ROTATION__INFERENCE=f"[127.0.0.1:{free_port()}]",
               KEEL_FEEDBACK_ROTATION__CALL_TIMEOUT_S="1", KEEL_FEEDBACK_ROTATION__RETRY__ATTEMPTS="2",
               KEEL_FEEDBACK_ROTATION__RETRY__INITIAL_BACKOFF_S="0.01")
    log = open(tmp_path / "feedback.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.feedback"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    try:
        health.wait_serving({"feedback": (target, "keel.feedback.v1.Feedback")}, 60, lambda: proc.poll() is None)
        with grpc.insecure_channel(target) as ch:
            yield feedback_pb2_grpc.FeedbackStub(ch), f"http://127.0.0.1:{hook}/rotation/alerts", port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def post(url: str, body: dict, token: str = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def rpc_error(call):
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return client.translate(exc.value)


def test_webhook_to_proposal_to_approval_over_the_stage_api(stage):
    stub, url, _port = stage
    assert post(url, payload(), token="nope")[0] == 401
    status, body = post(url, payload())
    assert status == 200 and body["decisions"][0]["outcome"] == "proposed"

    st = stub.RotationStatus(feedback_pb2.RotationStatusRequest(), metadata=MD, timeout=30)
    assert st.mode == "propose" and st.webhook_url.endswith("/rotation/alerts")
    assert [p.id for p in st.proposals] == [1] and st.replicas[0].active == "" and st.replicas[0].error
    assert {c.action for c in st.cooldowns} == {"switch_variant", "retrain_adapters", "resample_data"}
    history = stub.RotationHistory(feedback_pb2.RotationHistoryRequest(), metadata=MD, timeout=30).decisions
    assert [(d.id, d.rule, d.outcome, d.snapshot["e2e_latency_p99_seconds"]) for d in history] == [
        (1, "KeelRotationSwitchToFallback", "proposed", "2.5")]

    dry = stub.RotationDryRun(feedback_pb2.RotationDryRunRequest(alerts=[feedback_pb2.RotationAlert(
        labels={"alertname": "KeelRotationSwitchToFallback", "keel_action": "switch_variant", "variant": "fallback"},
        fingerprint="other", starts_at="2026-12-01T12:00:00Z", status="firing")]), metadata=MD, timeout=30)
    assert dry.verdicts[0].would.startswith("cooldown: decision 1")

    for request, code, reason in (
            (feedback_pb2.ApproveDecisionRequest(id=1), "INVALID_ARGUMENT", "MISSING_ACTOR"),
            (feedback_pb2.ApproveDecisionRequest(id=99, actor="alice"), "NOT_FOUND", "DECISION_NOT_FOUND")):
        err = rpc_error(lambda: stub.ApproveDecision(request, metadata=MD, timeout=30))
        assert (err.code, err.reason) == (code, reason)
    failed = stub.ApproveDecision(feedback_pb2.ApproveDecisionRequest(id=1, actor="alice"), metadata=MD,
                                  timeout=60).decision
    assert (failed.outcome, failed.actor, failed.attempts) == ("failed", "alice", 2)
    assert "VARIANT_SWITCH_FAILED" in failed.detail and "SetVariant(fallback) failed" in failed.detail
    err = rpc_error(lambda: stub.ApproveDecision(feedback_pb2.ApproveDecisionRequest(id=1, actor="bob"),
                                                 metadata=MD, timeout=30))
    assert (err.code, err.reason, err.metadata["outcome"]) == ("FAILED_PRECONDITION", "DECISION_NOT_PROPOSED", "failed")

    err = rpc_error(lambda: stub.RotationDryRun(feedback_pb2.RotationDryRunRequest(alerts=[
        feedback_pb2.RotationAlert(labels={"alertname": "A", "keel_action": "switch_variant"}, fingerprint="f",
                                   starts_at="t", status="bogus")]), metadata=MD, timeout=30))
    assert (err.code, err.reason, err.metadata["field"]) == ("INVALID_ARGUMENT", "INVALID_ALERT_PAYLOAD",
                                                             "alerts[0].status")
    err = rpc_error(lambda: stub.RotationHistory(feedback_pb2.RotationHistoryRequest(), timeout=30))
    assert err.code == "UNAUTHENTICATED"


def keel_rotation(tmp_path, port: int, *args: str) -> subprocess.CompletedProcess:
    layout = yaml.safe_load((ROOT / "config" / "keel.yaml").read_text())
    layout["stages"]["feedback"]["ports"] = [port]
    (tmp_path / "keel.json").write_text(json.dumps(layout))
    env = dict(os.environ, KEEL_KEEL_CONFIG=str(tmp_path / "keel.json"), KEEL_VAR_DIR=str(tmp_path / "cli-var"),
               KEEL_MESH_TOKEN=TOKEN)
    return subprocess.run([sys.executable, "-m", "keelctl", "rotation", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_keel_rotation_shows_and_approves_a_proposal(stage, tmp_path):
    stub, url, port = stage
    assert post(url, payload())[0] == 200
    status = keel_rotation(tmp_path, port, "status")
    assert status.returncode == 0, status.stderr
    assert "mode: propose" in status.stdout and "proposals waiting: 1" in status.stdout
    assert "switch_variant    cooldown 3600 s: " in status.stdout
    history = keel_rotation(tmp_path, port, "history")
    assert history.stdout.startswith("#1 ") and "[firing] switch_variant -> proposed (propose, by alertmanager)" \
        in history.stdout
    approved = keel_rotation(tmp_path, port, "approve", "1", "--actor", "carol")
    assert approved.returncode == 1 and "-> failed (propose, by carol)" in approved.stdout  # no replica runs
    again = keel_rotation(tmp_path, port, "approve", "1", "--actor", "carol")
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr
