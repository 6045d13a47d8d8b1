"""Generation controls through the real mesh (the session's one mesh): stop strings unary and
streamed, penalties, logprobs, JSON Schema / regex / choice answers (the validator's json_schema
plugin confirms the JSON), `keel replay` of a stopped and of a constrained, penalised answer, and
one refusal of each class (the gateway's contract, the grammar)."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from keel.common.v1 import common_pb2
from testing.mesh import wait_until
from tests.e2e.conftest import error_info
from tests.e2e.test_cli import keel
from tests.e2e.test_feedback import store

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TIMEOUT = 240
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
     "additionalProperties": False},
]


def _stream_text(stub, req, md) -> tuple[str, object, list]:
    items = list(stub.GenerateStream(req, metadata=md, timeout=TIMEOUT))
    deltas = [i for i in items if i.WhichOneof("event") == "delta"]
    return "".join(d.delta for d in deltas), items[-1].done, [lp for d in deltas for lp in d.logprobs]


def test_stop_string_ends_the_answer_before_it_unary_and_streamed(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = mesh.stub(ch)
        req = gateway_request("List the days of the week, one per line.", max_tokens=16, seed=1)
        raw, done, _ = _stream_text(stub, req, api_md)
        k = next(i for i in range(len(raw) // 3, 2 * len(raw) // 3) if raw.find(raw[i:i + 2]) == i)
        stop = raw[k:k + 2]
        req.sampling.stop.append(stop)
        cut, sdone, _ = _stream_text(stub, req, api_md)
        unary = stub.Generate(req, metadata=api_md, timeout=TIMEOUT)
    assert cut == raw[:k] and stop not in cut
    assert sdone.finish_reason == unary.finish_reason == "stop"
    assert unary.usage.completion_tokens == sdone.usage.completion_tokens < done.usage.completion_tokens
    assert unary.text == sdone.text and stop not in unary.text
    assert_replays_identically(mesh, unary.trace_id)


def assert_replays_identically(mesh, trace_id: str) -> None:
    """`keel replay` sends the recorded controls again and finds the same tokens."""
    wait_until(lambda: store(mesh).get_record(trace_id), 30, "the replay record")
    out = keel(mesh, "replay", trace_id)
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr


def test_penalties_change_a_repetitive_answer_deterministically_and_logprobs_come_back(mesh, api_md,
                                                                                        gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = mesh.stub(ch)
        plain = stub.Generate(gateway_request("Say the word cat ten times.", max_tokens=12, seed=2), metadata=api_md,
                              timeout=TIMEOUT)
        req = gateway_request("Say the word cat ten times.", max_tokens=12, seed=2)
        req.sampling.presence_penalty, req.sampling.repetition_penalty = 2.0, 1.5
        req.sampling.logprobs, req.sampling.top_logprobs = True, 3
        first = stub.Generate(req, metadata=api_md, timeout=TIMEOUT)
        again, _, streamed = _stream_text(stub, req, api_md)
    assert first.text != plain.text and not plain.logprobs
    assert len(first.logprobs) == first.usage.completion_tokens and [lp.token_id for lp in streamed] == \
        [lp.token_id for lp in first.logprobs]
    for lp in first.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token_id == lp.token_id  # greedy
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.top_logprobs[2].logprob
    assert "".join(lp.token for lp in first.logprobs) == again  # each token's text, as streamed


def test_constrained_answers_parse_validate_and_pass_the_validators_json_schema_plugin(mesh, api_md,
                                                                                         gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        for i, schema in enumerate(SCHEMAS):
            req = gateway_request("Answer in JSON about Paris.", max_tokens=48, seed=i)
            req.response_format.json_schema = json.dumps(schema)
            resp = mesh.stub(ch).Generate(req, metadata=api_md, timeout=TIMEOUT)
            jsonschema.validate(json.loads(resp.text), schema)
            assert resp.finish_reason == "stop"
            assert not [v for v in resp.validation.verdicts if v.plugin == "json_schema" and not v.passed]


def test_regex_and_choice_answers_match(mesh, api_md, gateway_request):
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = mesh.stub(ch)
        req = gateway_request("Give a product code.", max_tokens=12, seed=3)
        req.response_format.regex = r"[A-Z]{3}-[0-9]{4}"
        req.sampling.frequency_penalty = 0.5
        coded = stub.Generate(req, metadata=api_md, timeout=TIMEOUT)
        req = gateway_request("Is the sky blue?", max_tokens=8, seed=4)
        req.response_format.choice.values.extend(["yes", "no"])
        chosen, sdone, _ = _stream_text(stub, req, api_md)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", coded.text)
    assert chosen in ("yes", "no") and sdone.text == chosen
    assert_replays_identically(mesh, coded.trace_id)  # constrained and penalised


def test_bad_controls_are_refused_with_the_reason_naming_the_field(mesh, api_md, gateway_request):
    bad_penalty = gateway_request("hi", max_tokens=4)
    bad_penalty.sampling.frequency_penalty = 3.0
    bad_schema = gateway_request("hi", max_tokens=4)
    bad_schema.response_format.json_schema = '{"type": "frobnicate"}'
    bad_choice = gateway_request("hi", max_tokens=4)
    bad_choice.response_format.choice.SetInParent()
    with grpc.insecure_channel(mesh.gateway) as ch:
        for req, reason, field in ((bad_penalty, "FREQUENCY_PENALTY_OUT_OF_RANGE", "sampling.frequency_penalty"),
                                   (bad_schema, "RESPONSE_FORMAT_INVALID", "response_format.json_schema"),
                                   (bad_choice, "CHOICE_INVALID", "response_format.choice")):
            with pytest.raises(grpc.RpcError) as err:
                mesh.stub(ch).Generate(req, metadata=api_md, timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            info = error_info(err.value)
            assert info.reason == reason and info.metadata["field"] == field
    assert common_pb2.ResponseFormat(choice=common_pb2.Choices()).WhichOneof("format") == "choice"
