"""The feedback loop on the running mesh: a replay record per answer, SubmitFeedback through the
gateway, `keel replay` of a recorded request, `keel feedback list` and `keel etl run`."""
from __future__ import annotations

import http.server
import json
import threading

import grpc
import pytest

from keel.gateway.v1 import gateway_pb2
from keelctl.ask import DEV_API_KEY, build_request
from services.feedback.store import open_store
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from shared.modelfile import source as model_source
from testing.mesh import wait_until
from tests.e2e.conftest import error_info
from tests.e2e.test_cli import keel

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def store(mesh):
    return open_store(f"sqlite:///{mesh.tmp / 'var' / 'feedback' / 'feedback.db'}")


def item(trace_id: str, **kw) -> gateway_pb2.SubmitFeedbackRequest:
    values = {"feedback_id": f"fb-{trace_id[:8]}", "error_type": "fact_error", "severity": "severe",
              "expected_keywords": ["Paris"], "comment": "wrong"}
    values.update(kw)
    return gateway_pb2.SubmitFeedbackRequest(trace_id=trace_id, **values)


@pytest.fixture(scope="module")
def answered(mesh):
    """One answer sampled at temperature 0.8 with no client seed: the gateway picks and records one."""
    request = build_request("What is the capital of France?", max_tokens=12, temperature=0.8)
    with grpc.insecure_channel(mesh.gateway) as ch:
        return mesh.stub(ch).Generate(request, metadata=(("x-api-key", DEV_API_KEY),), timeout=120)


def test_every_answer_leaves_a_replay_record_with_the_seed_the_gateway_picked(mesh, answered):
    rec = wait_until(lambda: store(mesh).get_record(answered.trace_id), 30, "the replay record")
    assert rec.sampling.seed == answered.seed and rec.sampling.temperature == pytest.approx(0.8)
    assert len(rec.prompt_ids) == answered.usage.prompt_tokens
    assert len(rec.output_ids) == answered.usage.completion_tokens
    assert rec.finish_reason == answered.finish_reason and rec.engine["format"]
    # the engine facts behind the client's system_fingerprint are in the record, field by field
    assert {"weights_sha256", "format", "torch", "blas_build", "cpu_capability", "threads",
            "engine_version"} <= set(rec.engine)
    assert len(answered.system_fingerprint) == 16
    assert len(rec.prompt_sha256) == len(rec.output_sha256) == len(rec.raw_text_sha256) == 64
    assert "entropy_mean" in rec.validation["probes"]
    # the tokenizer stage's identity, as its Encode reported it: the hashes of the vocabulary in use
    tok = Tokenizer.open(compiled_path(model_source()))
    tok.warmup()
    assert (rec.vocab_sha256, rec.chat_template_sha256) == (tok.vocab_sha256, tok.chat_template_sha256)


def test_submit_feedback_through_the_gateway(mesh, api_md, answered):
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = mesh.stub(ch)
        assert stub.SubmitFeedback(item(answered.trace_id), metadata=api_md, timeout=30).created
        assert not stub.SubmitFeedback(item(answered.trace_id, severity="moderate"), metadata=api_md,
                                       timeout=30).created
        for bad, code, reason in (
                (item("0" * 32), grpc.StatusCode.NOT_FOUND, "TRACE_NOT_FOUND"),
                (item(answered.trace_id, error_type="typo"), grpc.StatusCode.INVALID_ARGUMENT,
                 "INVALID_FEEDBACK_FIELD"),
                (item(answered.trace_id, feedback_id=""), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FEEDBACK_FIELD")):
            with pytest.raises(grpc.RpcError) as exc:
                stub.SubmitFeedback(bad, metadata=api_md, timeout=30)
            assert exc.value.code() == code and error_info(exc.value).reason == reason
        with pytest.raises(grpc.RpcError) as exc:
            stub.SubmitFeedback(item(answered.trace_id), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rows = store(mesh).list_feedback()
    assert [(r["trace_id"], r["severity"]) for r in rows if r["trace_id"] == answered.trace_id] == [
        (answered.trace_id, "moderate")]


def test_keel_replay_reports_identical(mesh, answered):
    wait_until(lambda: store(mesh).get_record(answered.trace_id), 30, "the replay record")
    out = keel(mesh, "replay", answered.trace_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("identical")


def test_keel_replay_of_several_ids_prints_each_with_progress_lines_off_a_terminal(mesh, answered):
    wait_until(lambda: store(mesh).get_record(answered.trace_id), 30, "the replay record")
    out = keel(mesh, "replay", answered.trace_id, answered.trace_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [line.split()[:2] for line in out.stdout.splitlines()] == [[answered.trace_id, "identical"]] * 2
    assert [line.split(",")[0] for line in out.stderr.splitlines()] == [
        "replaying: 0/2 (0%)", "replaying: 1/2 (50%)", "replaying: 2/2 (100%)", "replaying: 2/2 (100%) done"]


def test_keel_feedback_submit_list_and_etl(mesh, answered, tmp_path):
    wait_until(lambda: store(mesh).get_record(answered.trace_id), 30, "the replay record")
    out = keel(mesh, "feedback", "submit", answered.trace_id, "--id", "cli-1", "--error-type", "fact_error",
               "--severity", "severe", "--keyword", "Paris")
    assert out.returncode == 0 and out.stdout.split()[0] in ("created", "updated"), out.stdout + out.stderr
    out = keel(mesh, "feedback", "list", "--since", "1h")
    assert any(json.loads(line)["feedback_id"] == "cli-1" for line in out.stdout.splitlines())
    out = keel(mesh, "etl", "run", "--since", "1h", "--out", str(tmp_path / "ds"))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(x) for x in (tmp_path / "ds" / "train.jsonl").read_text().splitlines()] + \
        [json.loads(x) for x in (tmp_path / "ds" / "val.jsonl").read_text().splitlines()]
    assert any(x["source_trace_id"] == answered.trace_id for x in lines)


def test_keel_verify_determinism_replays_a_sample_and_pushes_its_metric(mesh, answered, tmp_path):
    wait_until(lambda: store(mesh).get_record(answered.trace_id), 30, "the replay record")
    pushed: list[bytes] = []

    class Pushgateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            pushed.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Pushgateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = keel(mesh, "verify", "determinism", "--sample", "2", "--since", "1h",
                   "--metrics-file", str(tmp_path / "determinism.prom"),
                   "--push-gateway", f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stdout + out.stderr
    # A replay that ran out of time on a loaded machine counts as failed, never as a mismatch.
    counts = dict(kv.split("=") for kv in out.stdout.splitlines()[-1].split())
    assert counts["mismatch"] == "0" and int(counts["identical"]) >= 1
    assert int(counts["identical"]) + int(counts["failed"]) == 2
    text = (tmp_path / "determinism.prom").read_text()
    assert f'keel_determinism_checks_total{{result="identical"}} {counts["identical"]}.0' in text
    assert pushed and b"keel_determinism_checks_total" in pushed[0]
