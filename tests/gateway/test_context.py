"""The context window: a prompt is never cut unless the client asks (truncate_prompt_tokens, the
last N tokens kept, flagged in the answer and on the span); prompt plus max_tokens beyond the
context is CONTEXT_LENGTH_EXCEEDED with the numbers; an absent max_tokens fits the context's room."""
from __future__ import annotations

import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.gateway.contract import Ask, Limits, check_ask
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.servicer import to_ask
from services.gateway.values import Call, Encoded
from shared import errors
from testing.upstreams import FakeUpstreams, no_sleep

LIMITS = Limits(max_context_tokens=100, max_tokens_limit=50, default_max_tokens=30)


class Prompt(FakeUpstreams):
    """A tokenizer whose prompt has ``length`` tokens: it cuts to max_length (keeping the last) and
    reports the length before the cut, as the tokenizer stage does."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.max_lengths, self.asks = length, [], []

    async def encode_chat(self, messages, max_length, timeout, md, **_):
        self.calls.append("encode")
        self.max_lengths.append(max_length)
        ids = list(range(self.length))[-max_length:]
        return Encoded(ids, len(ids) < self.length, self.length, "fp")

    def generate(self, enc, ask, seed, timeout, md):
        self.asks.append(ask)
        return super().generate(enc, ask, seed, timeout, md)


def pipeline(up) -> Pipeline:
    return Pipeline(up, RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), LIMITS,
                    rng=random.Random(7))


def ask(**kw) -> Ask:
    return Ask(messages=(("user", "hello"),), max_tokens=kw.pop("max_tokens", 10), **kw)


async def generate(up, a: Ask):
    return await pipeline(up).generate(a, Call(1e12, "t" * 32))


@pytest.mark.asyncio
async def test_a_prompt_that_fits_is_encoded_up_to_the_context_and_not_cut():
    up = Prompt(90)
    ans = await generate(up, ask(max_tokens=10))
    assert up.max_lengths == [100] and not ans.prompt_truncated and up.asks[0].max_tokens == 10


@pytest.mark.asyncio
@pytest.mark.parametrize("length,max_tokens", [(91, 10), (150, 10), (100, 1)])
async def test_prompt_and_max_tokens_beyond_the_context_are_refused_with_the_numbers(length, max_tokens):
    up = Prompt(length)
    with pytest.raises(errors.InvalidInput) as exc:
        await generate(up, ask(max_tokens=max_tokens))
    err = exc.value
    assert err.reason == "CONTEXT_LENGTH_EXCEEDED" and "generate" not in up.calls
    assert err.metadata == {"prompt_tokens": str(length), "max_tokens": str(max_tokens), "context_tokens": "100"}
    assert f"{length} in the prompt" in err.message and f"{max_tokens} to generate" in err.message


@pytest.mark.asyncio
async def test_truncation_only_when_asked_keeps_the_last_tokens_and_is_flagged():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = Prompt(150)
    with provider.get_tracer("t").start_as_current_span("gateway"):
        ans = await generate(up, ask(max_tokens=10, truncate_prompt_tokens=60))
    assert up.max_lengths == [60] and ans.prompt_truncated and ans.completion_tokens == 3
    attrs = next(s for s in exporter.get_finished_spans() if s.name == "gateway").attributes
    assert (attrs["prompt.truncated"], attrs["prompt.tokens"], attrs["prompt.original_tokens"]) == (True, 60, 150)
    # a prompt shorter than N is not cut, and the cut prompt must still leave room for max_tokens
    assert not (await generate(Prompt(40), ask(max_tokens=10, truncate_prompt_tokens=60))).prompt_truncated
    with pytest.raises(errors.InvalidInput) as exc:
        await generate(Prompt(150), ask(max_tokens=50, truncate_prompt_tokens=60))
    assert exc.value.metadata["prompt_tokens"] == "60"


@pytest.mark.asyncio
@pytest.mark.parametrize("length,served", [(10, 30), (85, 15), (99, 1)])
async def test_an_absent_max_tokens_asks_for_the_contexts_room_at_most_the_default(length, served):
    up = Prompt(length)
    await generate(up, ask(max_tokens=LIMITS.default_max_tokens, max_tokens_set=False))
    assert up.asks[0].max_tokens == served


@pytest.mark.asyncio
async def test_an_absent_max_tokens_with_a_prompt_that_fills_the_context_is_refused():
    with pytest.raises(errors.InvalidInput) as exc:
        await generate(Prompt(100), ask(max_tokens=LIMITS.default_max_tokens, max_tokens_set=False))
    assert exc.value.metadata == {"prompt_tokens": "100", "max_tokens": "1", "context_tokens": "100"}


@pytest.mark.parametrize("n", [-1, 100, 2**31 - 1])
def test_truncate_prompt_tokens_out_of_range_names_the_field(n):
    with pytest.raises(errors.InvalidInput) as exc:
        check_ask(ask(truncate_prompt_tokens=n), LIMITS)
    assert (exc.value.reason, exc.value.metadata["field"]) == ("TRUNCATE_PROMPT_TOKENS_OUT_OF_RANGE",
                                                               "sampling.truncate_prompt_tokens")


def test_the_servicer_reads_absent_max_tokens_and_truncation():
    req = gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(truncate_prompt_tokens=7))
    a = to_ask(req, LIMITS)
    assert (a.max_tokens, a.max_tokens_set, a.truncate_prompt_tokens) == (30, False, 7)
    a = to_ask(gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=5)), LIMITS)
    assert (a.max_tokens, a.max_tokens_set, a.truncate_prompt_tokens) == (5, True, 0)
