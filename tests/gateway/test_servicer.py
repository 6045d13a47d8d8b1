"""The gateway servicer's protobuf <-> domain conversion (to_ask, to_response, the stream events)."""
from __future__ import annotations

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.gateway.contract import Limits, check_ask
from services.gateway.recording import FeedbackDisabled
from services.gateway.servicer import GatewayServicer, to_ask, to_response
from services.gateway.values import Answer, Delta
from shared import errors

LIMITS = Limits(default_max_tokens=77)


def test_prompt_becomes_one_user_turn_with_defaults():
    ask = to_ask(gateway_pb2.GenerateRequest(prompt="hi", domain="med", source="web"), LIMITS)
    assert ask.messages == (("user", "hi"),) and ask.raw_prompt == "hi"
    assert ask.max_tokens == 77 and ask.top_p == 1.0 and ask.temperature == 0.0 and ask.top_k == 0
    assert ask.seed is None and ask.domain == "med" and ask.source == "web"


def test_chat_and_sampling_are_carried_and_seed_zero_is_a_seed():
    req = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="system", content="be brief"),
                                                common_pb2.ChatMessage(role="user", content="hi")]),
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=40, seed=0))
    ask = to_ask(req, LIMITS)
    assert ask.messages == (("system", "be brief"), ("user", "hi")) and ask.raw_prompt is None
    assert (ask.max_tokens, ask.temperature, ask.top_p, ask.top_k, ask.seed) == (5, 0.5, pytest.approx(0.9), 40, 0)


def test_no_input_becomes_an_ask_that_the_limits_refuse_as_empty_prompt():
    """Neither prompt nor chat still converts (so the refusal reaches the quarantine); check_ask refuses it."""
    ask = to_ask(gateway_pb2.GenerateRequest(), LIMITS)
    assert ask.messages == () and ask.raw_prompt is None
    with pytest.raises(errors.InvalidInput) as exc:
        check_ask(ask, LIMITS)
    assert exc.value.reason == "EMPTY_PROMPT"


def test_response_carries_every_field_and_the_validation_result_unchanged():
    validation = common_pb2.ValidationResult(
        passed=True, low_confidence=True, probes={"entropy_mean": 0.25},
        verdicts=[common_pb2.Verdict(plugin="pii", passed=False, message="an email", blocking=False),
                  common_pb2.Verdict(plugin="forbidden", passed=True, blocking=True)])
    answer = Answer(text="ok", finish_reason="length", prompt_tokens=12, completion_tokens=3, seed=9,
                    prompt_truncated=True, input_flags=["low_quality"], validation=validation, trace_id="t" * 32,
                    system_fingerprint="0123456789abcdef")
    resp = to_response(answer)
    assert (resp.text, resp.finish_reason, resp.seed, resp.trace_id) == ("ok", "length", 9, "t" * 32)
    assert resp.system_fingerprint == "0123456789abcdef"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (12, 3)
    assert resp.prompt_truncated and list(resp.input_flags) == ["low_quality"]
    assert resp.validation == validation
    assert [v.passed for v in resp.validation.verdicts] == [False, True]


class ScriptedPipeline:
    def __init__(self, items):
        self.items, self.asks = items, []

    async def stream(self, ask, call):
        self.asks.append((ask, call))
        for item in self.items:
            yield item


class Context:
    def time_remaining(self):
        return 5.0

    def invocation_metadata(self):
        return (("x-api-key", "k"), ("bin-bin", b"\x00"))


@pytest.mark.asyncio
async def test_stream_sends_deltas_then_the_summary():
    pipeline = ScriptedPipeline([Delta("Par"), Delta("is"), Answer(text="Paris", finish_reason="stop")])
    servicer = GatewayServicer(pipeline, LIMITS, FeedbackDisabled())
    events = [e async for e in servicer.GenerateStream(gateway_pb2.GenerateRequest(prompt="capital?"), Context())]
    assert [e.WhichOneof("event") for e in events] == ["delta", "delta", "done"]
    assert [e.delta for e in events[:2]] == ["Par", "is"] and events[2].done.text == "Paris"
    ask, call = pipeline.asks[0]
    assert ask.messages == (("user", "capital?"),) and call.inbound == {"x-api-key": "k"}  # text metadata only
    assert call.deadline > 0
