"""End to end: Redis + five stage processes under `keel up`, the real model, real gRPC."""
from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest
import redis

from keel.gateway.v1 import gateway_pb2
from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.validator.records import QuarantineRecord
from shared.clip import TRUNCATED
from testing.mesh import ROOT
from tests.e2e.conftest import error_info

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_question_is_answered_with_paris_and_a_trace_id(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        resp = mesh.stub(ch).Generate(gateway_request("What is the capital of France?", max_tokens=24),
                                      metadata=api_md, timeout=120)
    assert "Paris" in resp.text
    assert re.fullmatch(r"[0-9a-f]{32}", resp.trace_id)
    assert resp.usage.prompt_tokens > 10 and 0 < resp.usage.completion_tokens <= 24
    assert resp.finish_reason in ("stop", "length")
    assert resp.validation.passed
    # one verdict per output check of the domain, each passed
    assert resp.validation.verdicts and all(v.passed and v.plugin for v in resp.validation.verdicts)


def test_every_stage_is_crossed_and_traced(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        resp = mesh.stub(ch).Generate(gateway_request("Name a colour.", max_tokens=8), metadata=api_md, timeout=120)

    hops = {"gateway/Generate", "validator/ValidateInput", "tokenizer/Encode", "inference/Generate",
            "tokenizer/Decode", "validator/ValidateOutput"}

    def all_flushed():  # each process (two tokenizer workers among them) exports on its own schedule
        return hops <= {s["name"] for s in mesh.spans(resp.trace_id)}
    from testing.mesh import wait_until
    wait_until(all_flushed, 10, "spans of every hop")
    services = {s["service"] for s in mesh.spans(resp.trace_id)}
    assert services >= {"gateway", "validator", "tokenizer", "inference"}
    out = subprocess.run([sys.executable, "-m", "keelctl", "trace", resp.trace_id], cwd=ROOT, capture_output=True,
                         text=True, env={"KEEL_TRACES_DIR": str(mesh.tmp / "traces"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "inference: inference/Generate" in out.stdout and "gateway: gateway/Generate" in out.stdout


def test_stream_yields_deltas_then_summary(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        events = list(mesh.stub(ch).GenerateStream(gateway_request("What is the capital of France?", max_tokens=16),
                                                   metadata=api_md, timeout=120))
    deltas = [e.delta for e in events if e.WhichOneof("event") == "delta"]
    done = events[-1].done
    assert events[-1].WhichOneof("event") == "done" and len(deltas) >= 2
    assert "".join(deltas).strip() == done.text.strip()
    # the text came from one tokenizer DecodeStream; the answer was not decoded a second time
    from testing.mesh import wait_until
    wait_until(lambda: "tokenizer/DecodeStream" in {s["name"] for s in mesh.spans(done.trace_id)}, 10,
               "the DecodeStream span")
    names = [s["name"] for s in mesh.spans(done.trace_id)]
    assert names.count("tokenizer/DecodeStream") == 1 and "tokenizer/Decode" not in names


@pytest.mark.parametrize("build,reason", [
    (lambda r: r(""), "EMPTY_PROMPT"),
    (lambda r: r("   "), "EMPTY_PROMPT"),
    (lambda r: r(messages=[("wizard", "hi")]), "UNKNOWN_ROLE"),
    (lambda r: r("hi", max_tokens=100000), "MAX_TOKENS_TOO_LARGE"),
    (lambda r: r("x" * 40000), "PROMPT_TOO_LARGE"),
    (lambda r: r("hi", temperature=5.0), "TEMPERATURE_OUT_OF_RANGE"),
])
def test_bad_inputs_get_invalid_argument_with_reason(mesh, api_md, gateway_request, build, reason):
    with grpc.insecure_channel(mesh.gateway) as ch, pytest.raises(grpc.RpcError) as exc:
        mesh.stub(ch).Generate(build(gateway_request), metadata=api_md, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(exc.value).reason == reason


def test_max_tokens_zero_means_default_but_negative_is_rejected(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch, pytest.raises(grpc.RpcError) as exc:
        mesh.stub(ch).Generate(gateway_request("hi", max_tokens=-1), metadata=api_md, timeout=30)
    assert error_info(exc.value).reason == "MAX_TOKENS_INVALID"


def test_invalid_utf8_prompt_is_invalid_argument(mesh, api_md):
    # field 1 (prompt, a proto3 string) holding bytes that are not UTF-8: only a raw client can send it
    body = b"\x0a\x03\xff\xfe\x41"
    with grpc.insecure_channel(mesh.gateway) as ch, pytest.raises(grpc.RpcError) as exc:
        ch.unary_unary("/keel.gateway.v1.Gateway/Generate")(body, metadata=api_md, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(exc.value).reason == "MALFORMED_REQUEST"


def test_invalid_utf8_text_to_tokenizer_is_invalid_argument(mesh):
    token = mesh.state()["mesh_token"]
    with grpc.insecure_channel(f"127.0.0.1:{mesh.ports['tokenizer'][0]}") as ch, pytest.raises(grpc.RpcError) as exc:
        tokenizer_pb2_grpc.TokenizerStub(ch).Encode(tokenizer_pb2.EncodeRequest(text=b"ok \xff\xfe"),
                                                   metadata=(("x-keel-mesh-token", token),), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(exc.value).reason == "INVALID_UTF8"


@pytest.mark.parametrize("md,reason", [((), "MISSING_API_KEY"), ((("x-api-key", "wrong"),), "INVALID_API_KEY"),
                                       ((("x-api-key", "keel-dev-key"), ("x-api-key", "wrong")), "AMBIGUOUS_API_KEY")])
def test_gateway_requires_an_api_key(mesh, gateway_request, md, reason):
    with grpc.insecure_channel(mesh.gateway) as ch, pytest.raises(grpc.RpcError) as exc:
        mesh.stub(ch).Generate(gateway_request("hi"), metadata=md, timeout=30)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(exc.value).reason == reason


def test_stage_rejects_calls_from_outside_the_mesh(mesh):
    with grpc.insecure_channel(f"127.0.0.1:{mesh.ports['tokenizer'][0]}") as ch, pytest.raises(grpc.RpcError) as exc:
        tokenizer_pb2_grpc.TokenizerStub(ch).Decode(tokenizer_pb2.DecodeRequest(ids=[1]), timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(exc.value).reason == "MISSING_MESH_CREDENTIAL"


def test_every_refused_input_reaches_the_quarantine(mesh, api_md, gateway_request):
    """No prompt at all, a seed past the mesh's range, a prompt too large to send whole, a prompt of
    invisible characters: each is refused with its reason and its quarantine_id names a stored record."""
    cases = [(gateway_pb2.GenerateRequest(), "EMPTY_PROMPT"),
             (gateway_request("hi", seed=2**63), "SEED_OUT_OF_RANGE"),
             (gateway_request("\u0001" * 700_000), "PROMPT_TOO_LARGE"),
             (gateway_request("\u200b\u2060\ufeff"), "INVISIBLE_INPUT")]
    ids = []
    with grpc.insecure_channel(mesh.gateway) as ch:
        for req, reason in cases:
            with pytest.raises(grpc.RpcError) as exc:
                mesh.stub(ch).Generate(req, metadata=api_md, timeout=60)
            info = error_info(exc.value)
            assert (exc.value.code(), info.reason) == (grpc.StatusCode.INVALID_ARGUMENT, reason)
            assert info.metadata["quarantine_id"], reason
            ids.append(info.metadata["quarantine_id"])
    client = redis.Redis.from_url(mesh.state()["redis_url"], decode_responses=True)
    try:
        records = {f["record_id"]: QuarantineRecord.from_fields(f) for _, f in client.xrange("keel:quarantine")}
    finally:
        client.close()
    assert [records[i].reason for i in ids] == [reason for _, reason in cases]
    assert records[ids[2]].payload[TRUNCATED]["bytes"] > 4 * 1024 * 1024

