"""The gateway pipeline against a scripted in-process Upstreams (no grpc): order of hops,
seed fixing, blocked outputs, streamed text, retries of a failed hop."""
from __future__ import annotations

import asyncio
import random

import pytest

from services.gateway.contract import Ask, Limits, check_ask
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.values import Call, Delta, Done, Step
from shared import errors
from testing.upstreams import EMOJI, FakeUpstreams, no_sleep


def pipeline(up) -> Pipeline:
    ex = RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1))
    return Pipeline(up, ex, Limits(max_context_tokens=2048), rng=random.Random(7))


def ask(**kw) -> Ask:
    return Ask(messages=(("user", kw.pop("text", "hello")),), max_tokens=kw.pop("max_tokens", 8), **kw)


@pytest.mark.asyncio
async def test_hops_in_order_and_processed_text_returned():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(), Call(1e12, "t" * 32))
    assert up.calls == ["validate_input", "encode", "generate", "decode", "validate_output"]
    assert ans.text == "EFG" and ans.completion_tokens == 3 and ans.finish_reason == "stop"
    assert dict(ans.validation.probes) == {"entropy_mean": 0.5} and ans.validation.verdicts[0].passed


@pytest.mark.asyncio
async def test_seed_fixed_by_gateway_and_reused_on_retry():
    up = FakeUpstreams(fail_generate=1)
    ans = await pipeline(up).generate(ask(), Call(1e12, "t" * 32))
    assert up.calls.count("generate") == 2
    assert up.seeds[0] == up.seeds[1] == ans.seed  # the retried generation is the same request


@pytest.mark.asyncio
async def test_client_seed_is_echoed():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(seed=42), Call(1e12, "t" * 32))
    assert up.seeds == [42] and ans.seed == 42


@pytest.mark.asyncio
async def test_blocked_output_is_failed_precondition_naming_the_plugin():
    up = FakeUpstreams(verdict_pass=False)
    with pytest.raises(errors.PreconditionFailed) as exc:
        await pipeline(up).generate(ask(), Call(1e12, "t" * 32))
    assert exc.value.reason == "OUTPUT_BLOCKED" and exc.value.metadata["plugin"] == "forbidden"
    await asyncio.sleep(0)  # the report runs beside the answer
    assert up.reports == [("inference-a", "output_limit", "forbidden")]


@pytest.mark.asyncio
async def test_a_passed_output_reports_nothing_and_a_failed_report_never_reaches_the_client():
    up = FakeUpstreams()
    await pipeline(up).generate(ask(), Call(1e12, "t" * 32))
    await asyncio.sleep(0)
    assert up.reports == []

    class Unreachable(FakeUpstreams):
        async def report_failure(self, replica, kind, cause, md):
            raise errors.NotReady("gone", reason="CONNECTION_LOST")
    with pytest.raises(errors.PreconditionFailed):  # the answer's own status, not the report's
        await pipeline(Unreachable(verdict_pass=False)).generate(ask(), Call(1e12, "t" * 32))
    await asyncio.sleep(0)


async def stream(up) -> tuple[list[str], object]:
    items = [x async for x in pipeline(up).stream(ask(), Call(1e12, "t" * 32))]
    return [x.text for x in items if isinstance(x, Delta)], items[-1]


@pytest.mark.asyncio
async def test_stream_sends_a_real_replacement_character_at_once():
    # paced: "g" is generated only after the gateway decoded U+FFFD, so holding it back would
    # merge the two deltas.
    deltas, answer = await stream(FakeUpstreams(tokens=(12, 7), paced=True))
    assert deltas == ["\ufffd", "g"]
    assert answer.text == "\ufffdG"


@pytest.mark.asyncio
async def test_stream_sends_a_character_split_across_tokens_whole_with_its_last_token():
    up = FakeUpstreams(tokens=(10, 11, 7), paced=True)
    deltas, _ = await stream(up)
    assert deltas == [EMOJI, "g"]
    assert up.decoded == [(10,), (11,), (7,)]  # each id sent once (the end came with the last one)
    assert "decode" not in up.calls  # the answer is not decoded a second time


@pytest.mark.asyncio
async def test_stream_concatenation_is_the_text_validated_and_a_cut_character_is_flushed():
    up = FakeUpstreams(tokens=(1, 12, 10, 11, 13, 2, 10), paced=True)  # ends on half the emoji
    deltas, answer = await stream(up)
    assert "".join(deltas) == up.validated[0] == "a\ufffd" + EMOJI + "b\ufffd"
    assert answer.text == up.validated[0].upper()


@pytest.mark.asyncio
async def test_stream_decodes_tokens_that_arrived_together_in_one_batch():
    up = FakeUpstreams(tokens=(1, 2, 3, 4))  # unpaced: all four and the end wait before the first batch
    deltas, _ = await stream(up)
    assert deltas == ["abcd"] and up.decoded == [(1, 2, 3, 4)]


@pytest.mark.asyncio
async def test_stream_retry_after_a_lost_tokenizer_answer_resends_every_id_and_repeats_no_text():
    up = FakeUpstreams(tokens=(1, 10, 11, 2), paced=True, lose_response=3)  # the batch (11,) is lost
    deltas, answer = await stream(up)
    assert deltas == ["a", EMOJI, "b"]
    assert up.decoded == [(1,), (10,), (11,), (1, 10, 11), (2,)]
    assert up.calls.count("decode_stream") == 2 and up.closed == 1
    assert answer.text == ("a" + EMOJI + "b").upper()


@pytest.mark.asyncio
async def test_stream_failure_after_tokens_ends_the_call_with_its_status():
    class Dies(FakeUpstreams):
        async def generate(self, enc, ask, seed, timeout, md):
            self.calls.append("generate")
            yield Step(5, 0.5)
            raise errors.NotReady("replica died", reason="NOT_SERVING")

    up = Dies()
    got = []
    with pytest.raises(errors.NotReady) as exc:
        async for x in pipeline(up).stream(ask(), Call(1e12, "t" * 32)):
            got.append(x)
    assert exc.value.reason == "NOT_SERVING"
    assert up.calls.count("generate") == 1  # tokens were out: no retry that would repeat text
    assert up.decoded == [(5,)] and [d.text for d in got] == ["e"]
    assert up.closed == 1  # the unfinished decode stream is cancelled


@pytest.mark.asyncio
async def test_input_flags_are_carried():
    up = FakeUpstreams()
    ans = await pipeline(up).generate(ask(text="meh"), Call(1e12, "t" * 32))
    assert ans.input_flags == ["low_quality"]


@pytest.mark.parametrize("bad,reason", [
    (Ask(messages=(), max_tokens=8), "EMPTY_PROMPT"),
    (Ask(messages=(("user", "  "),), max_tokens=8), "EMPTY_PROMPT"),
    (Ask(messages=(("robot", "hi"),), max_tokens=8), "UNKNOWN_ROLE"),
    (Ask(messages=(("user", "hi"),), max_tokens=0), "MAX_TOKENS_INVALID"),
    (Ask(messages=(("user", "hi"),), max_tokens=5000), "MAX_TOKENS_TOO_LARGE"),
    (Ask(messages=(("user", "hi"),), max_tokens=8, temperature=-1), "TEMPERATURE_OUT_OF_RANGE"),
    (Ask(messages=(("user", "hi"),), max_tokens=8, top_p=1.5), "TOP_P_OUT_OF_RANGE"),
    (Ask(messages=(("user", "x" * 40000),), max_tokens=8), "PROMPT_TOO_LARGE"),
])
def test_check_ask_rejects_with_reason(bad, reason):
    with pytest.raises(errors.InvalidInput) as exc:
        check_ask(bad, Limits(max_context_tokens=2048))
    assert exc.value.reason == reason


@pytest.mark.asyncio
async def test_rejected_input_never_reaches_inference_even_though_encoding_runs_beside_the_check():
    class Rejecting(FakeUpstreams):
        async def validate_input(self, payload, source, domain, timeout, md):
            self.calls.append("validate_input")
            raise errors.InvalidInput("injection", reason="PROMPT_INJECTION", metadata={"rule": "role_marker"})

    up = Rejecting()
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(ask(), Call(1e12, "t" * 32))
    assert exc.value.reason == "PROMPT_INJECTION" and exc.value.metadata["rule"] == "role_marker"
    assert "generate" not in up.calls and "decode" not in up.calls


@pytest.mark.asyncio
async def test_input_rejected_by_gateway_limits_is_still_quarantined():
    up = FakeUpstreams()
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(up).generate(ask(text="x" * 40000), Call(1e12, "t" * 32))
    assert exc.value.reason == "PROMPT_TOO_LARGE" and exc.value.metadata["quarantine_id"] == "q-1"
    assert [r for r, _ in up.quarantined] == ["PROMPT_TOO_LARGE"]
    assert up.quarantined[0][1]["messages"][0]["content"] == "x" * 40000  # the full payload
    assert up.calls == ["validate_input"]  # nothing else was spent on it


def test_the_system_fingerprint_names_the_engine_facts_and_changes_with_any_of_them():
    facts = {"weights_sha256": "ab" * 32, "format": "int8", "torch": "2.13.0", "threads": "1"}
    one = Done("stop", 3, 2, 7, facts).system_fingerprint
    assert len(one) == 16 and int(one, 16) >= 0
    assert Done("length", 9, 9, 1, dict(reversed(list(facts.items())))).system_fingerprint == one  # facts only
    assert Done("stop", 3, 2, 7, {**facts, "format": "bfloat16"}).system_fingerprint != one
    assert Done("stop", 3, 2, 7, {}).system_fingerprint == ""
