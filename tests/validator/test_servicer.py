"""The validator servicer's protobuf <-> domain conversion (the core is a recording fake)."""
from __future__ import annotations

import pytest

from keel.validator.v1 import validator_pb2
from services.validator.output_pipeline import OutputResult
from services.validator.plugins import Verdict
from services.validator.servicer import ValidatorServicer, to_result


def result(**kw) -> OutputResult:
    base = dict(text="t", blocked=False, verdicts=[], probes={}, low_confidence=False)
    return OutputResult(**{**base, **kw})


def test_one_verdict_per_check_failed_first_then_passed():
    r = to_result(result(blocked=True, verdicts=[Verdict("has an email", plugin="pii", blocking=True)],
                         passed_checks=(("length", True), ("tone", False))))
    assert not r.passed
    assert [(v.plugin, v.passed, v.message, v.blocking) for v in r.verdicts] == [
        ("pii", False, "has an email", True), ("length", True, "", True), ("tone", True, "", False)]


def test_all_passed():
    r = to_result(result(passed_checks=(("pii", True),)))
    assert r.passed and [(v.plugin, v.passed) for v in r.verdicts] == [("pii", True)]


def test_probes_travel_as_floats_booleans_as_0_or_1_and_low_confidence_is_kept():
    r = to_result(result(probes={"entropy_mean": 1.5, "disclaimer": True, "contradiction": False},
                         low_confidence=True))
    assert dict(r.probes) == {"entropy_mean": 1.5, "disclaimer": 1.0, "contradiction": 0.0}
    assert r.low_confidence


class RecordingCore:
    """Records what the servicer hands the core; answers as scripted."""

    def __init__(self):
        self.calls = []

    def quarantine_rejected(self, payload_json, **kw):
        self.calls.append(("quarantine_rejected", payload_json, kw))

    def validate_input(self, payload_json, **kw):
        self.calls.append(("validate_input", payload_json, kw))
        return ["low_quality"], "q-7"

    def validate_output(self, text, **kw):
        self.calls.append(("validate_output", text, kw))
        return result(text=text.strip(), passed_checks=(("pii", True),))


@pytest.mark.asyncio
async def test_validate_input_defaults_source_and_domain_and_returns_flags():
    core = RecordingCore()
    resp = await ValidatorServicer(core, lambda *a: None).ValidateInput(
        validator_pb2.ValidateInputRequest(payload_json='{"prompt": "hi"}'), None)
    assert list(resp.flags) == ["low_quality"] and resp.quarantine_id == "q-7"
    ((name, payload, kw),) = core.calls
    assert (name, payload, kw["source"], kw["domain"]) == ("validate_input", '{"prompt": "hi"}', "default", "default")


@pytest.mark.asyncio
async def test_validate_input_with_a_gateway_rejection_quarantines_it_first():
    core = RecordingCore()
    await ValidatorServicer(core, lambda *a: None).ValidateInput(validator_pb2.ValidateInputRequest(
        payload_json="{}", source="web", domain="med", rejected_reason="PROMPT_TOO_LARGE", rejected_message="big"),
        None)
    (name, _, kw), (then, _, _) = core.calls
    assert name == "quarantine_rejected" and then == "validate_input"
    assert (kw["reason"], kw["message"], kw["source"], kw["domain"]) == ("PROMPT_TOO_LARGE", "big", "web", "med")


@pytest.mark.asyncio
async def test_validate_output_converts_request_and_result_and_tells_the_observer():
    core, observed = RecordingCore(), []
    resp = await ValidatorServicer(core, lambda r, n: observed.append((r.text, n))).ValidateOutput(
        validator_pb2.ValidateOutputRequest(text=" answer ", token_entropies=[0.5, 1.0], prompt="q?"), None)
    ((_, text, kw),) = core.calls
    assert text == " answer " and kw["domain"] == "default" and kw["prompt"] == "q?"
    assert kw["token_entropies"] == [0.5, 1.0]
    assert resp.text == "answer" and resp.result.passed and resp.result.verdicts[0].plugin == "pii"
    assert observed == [("answer", 2)]
