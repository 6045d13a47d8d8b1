"""Raw text and token-id inputs, echo and prompt scores through the gateway pipeline, against the
scripted Upstreams (testing/upstreams.py: ids are letters, 1 = "a")."""
from __future__ import annotations

import random

import pytest

from keel.gateway.v1 import gateway_pb2
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.servicer import to_ask, to_response
from services.gateway.values import Call
from shared import errors
from shared.controls import Controls
from shared.encoding import ids_fingerprint
from testing.upstreams import FakeUpstreams, no_sleep

LIMITS = Limits(max_context_tokens=64)


def pipeline(up) -> Pipeline:
    return Pipeline(up, RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), LIMITS,
                    rng=random.Random(7))


def call() -> Call:
    return Call(1e12, "t" * 32)


def ask(**kw) -> Ask:
    return Ask(messages=kw.pop("messages", ()), max_tokens=kw.pop("max_tokens", 4), **kw)


@pytest.mark.asyncio
async def test_text_is_encoded_as_it_is_and_the_contract_sees_it_as_the_prompt():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(text="abc"), call())
    assert "encode_text" in up.calls and "encode" not in up.calls  # no chat template
    assert up.encoded[0].ids == [1, 2, 3] and up.payloads[0]["prompt"] == "abc"
    assert ans.text == "EFG" and ans.prompt_tokens == 3


@pytest.mark.asyncio
async def test_token_ids_are_decoded_for_the_contract_and_generated_from_as_sent():
    up = FakeUpstreams()
    await pipeline(up).generate(ask(token_ids=(4, 5, 6)), call())
    assert up.calls[:2] == ["decode", "validate_input"] and "encode" not in up.calls
    assert up.payloads[0]["prompt"] == "def"
    assert up.encoded[0].ids == [4, 5, 6] and up.encoded[0].fingerprint == ids_fingerprint([4, 5, 6])


@pytest.mark.asyncio
async def test_token_ids_outside_the_vocabulary_are_refused_and_quarantined_as_ids():
    up = FakeUpstreams()
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(ask(token_ids=(1, 999)), call())
    assert exc.value.reason == "TOKEN_ID_OUT_OF_RANGE" and "generate" not in up.calls
    assert up.quarantined == [("TOKEN_ID_OUT_OF_RANGE", {**up.quarantined[0][1], "token_ids": [1, 999]})]


@pytest.mark.asyncio
async def test_truncate_prompt_tokens_keeps_the_last_ids_and_flags_the_cut():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(token_ids=(1, 2, 3, 4, 5), truncate_prompt_tokens=2), call())
    assert up.encoded[0].ids == [4, 5] and ans.prompt_truncated


@pytest.mark.asyncio
async def test_too_many_token_ids_are_a_context_error_before_any_hop():
    up = FakeUpstreams()
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(ask(token_ids=tuple([1] * 64)), call())
    assert exc.value.reason == "CONTEXT_LENGTH_EXCEEDED" and exc.value.metadata["prompt_tokens"] == "64"
    assert "decode" not in up.calls and "generate" not in up.calls


@pytest.mark.asyncio
@pytest.mark.parametrize("bad,reason,field", [
    (dict(token_ids=(1,), text="a"), "INPUT_AMBIGUOUS", "token_ids"),
    (dict(token_ids=(1,), messages=(("user", "a"),)), "INPUT_AMBIGUOUS", "token_ids"),
    (dict(messages=(("user", "a"),), controls=Controls(echo=True)), "ECHO_UNSUPPORTED", "sampling.echo"),
    (dict(text=" \n"), "EMPTY_PROMPT", None),
    (dict(text="a" * 40000), "PROMPT_TOO_LARGE", None),
    (dict(text="a", controls=Controls(prompt_logprobs=6)), "PROMPT_LOGPROBS_OUT_OF_RANGE", "sampling.prompt_logprobs"),
])
async def test_malformed_inputs_are_refused_with_their_reason_and_quarantined(bad, reason, field):
    up = FakeUpstreams()
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(ask(**bad), call())
    assert exc.value.reason == reason and exc.value.metadata.get("field") == field
    assert [r for r, _ in up.quarantined] == [reason] and "generate" not in up.calls


@pytest.mark.asyncio
async def test_echo_repeats_the_prompt_before_the_validated_answer():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(text="abc", controls=Controls(echo=True)), call())
    assert ans.text == "abc" + "EFG" and up.validated == ["efg"]  # output validation sees the answer only
    ids = await pipeline(up).generate(ask(token_ids=(1, 2), controls=Controls(echo=True)), call())
    assert ids.text == "ab" + "EFG"


@pytest.mark.asyncio
async def test_echo_of_a_cut_prompt_repeats_the_part_kept():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(text="abcd", truncate_prompt_tokens=2, controls=Controls(echo=True)), call())
    assert ans.text == "cd" + "EFG"


@pytest.mark.asyncio
async def test_echo_is_refused_on_a_stream():
    up = FakeUpstreams()
    with pytest.raises(errors.InvalidInput) as exc:
        async for _ in pipeline(up).stream(ask(text="abc", controls=Controls(echo=True)), call()):
            pass
    assert exc.value.reason == "ECHO_UNSUPPORTED" and "generate" not in up.calls
    assert [r for r, _ in up.quarantined] == ["ECHO_UNSUPPORTED"]


@pytest.mark.asyncio
async def test_prompt_scores_pass_through_to_the_answer():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(text="abc", controls=Controls(prompt_logprobs=1)), call())
    assert [(t.token, t.logprob) for t in ans.prompt_logprobs] == [("a", 0.0), ("b", -1.0), ("c", -2.0)]
    assert [t.token for t in to_response(ans).prompt_logprobs] == ["a", "b", "c"]
    plain = await pipeline(up).generate(ask(text="abc"), call())
    assert not plain.prompt_logprobs


def test_the_servicer_reads_each_input_kind():
    req = gateway_pb2.GenerateRequest(text="x y")
    req.sampling.echo = True
    req.sampling.prompt_logprobs = 0
    a = to_ask(req, LIMITS)
    assert (a.text, a.messages, a.token_ids, a.controls.echo, a.controls.prompt_logprobs) == ("x y", (), (), True, 0)
    ids = to_ask(gateway_pb2.GenerateRequest(token_ids=[3, 4]), LIMITS)
    assert (ids.text, ids.token_ids) == (None, (3, 4))
    assert to_ask(gateway_pb2.GenerateRequest(prompt="p"), LIMITS).messages == (("user", "p"),)
    assert to_ask(gateway_pb2.GenerateRequest(), LIMITS).controls.prompt_logprobs is None
