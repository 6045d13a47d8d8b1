"""Tokenize and Detokenize: the tokenizer stage through the gateway's hops, held to its prompt
limits; a text beyond the context is CONTEXT_LENGTH_EXCEEDED, never cut; over gRPC the calls are
authenticated, rate limited and traced by the gateway's interceptor like Generate."""
from __future__ import annotations

import random

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from keel.gateway.v1 import gateway_pb2
from services.gateway import tools
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.tokens import Tokens
from services.gateway.values import Call, Encoded
from shared import errors
from testing.upstreams import FakeUpstreams, no_sleep
from tests.gateway.served import served_gateway
from tests.gateway.test_auth_failures import shipped_config, stage_with

LIMITS = Limits(max_context_tokens=8, max_prompt_bytes=64)
CALL = Call(1e12, "t" * 32)


class Tokenizer(FakeUpstreams):
    """One id per character (its code point); chat renders "role:content|" per turn, then "A:"."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []

    @staticmethod
    def _cut(ids: list[int], max_length: int) -> Encoded:
        return Encoded(ids[-max_length:], len(ids) > max_length, len(ids), "fp")

    async def encode_text(self, text, max_length, timeout, md):
        self.seen.append(("text", text, max_length))
        return self._cut([ord(c) for c in text], max_length)

    async def encode_chat(self, messages, max_length, timeout, md, add_generation_prompt=True, **_):
        self.seen.append(("chat", messages, add_generation_prompt))
        text = "".join(f"{r[0]}{c}|" for r, c in messages) + ("A" if add_generation_prompt else "")
        return self._cut([ord(c) for c in text], max_length)

    async def decode(self, ids, timeout, md, skip_special_tokens=True):
        self.seen.append(("decode", list(ids), skip_special_tokens))
        return "".join(chr(i) for i in ids)


def chat(*messages, **kw) -> Ask:
    return Ask(messages=tuple(messages), max_tokens=0, **kw)


def tokens(up=None) -> Tokens:
    pipeline = Pipeline(up or Tokenizer(), RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), LIMITS)
    return Tokens(pipeline, LIMITS)


@pytest.mark.asyncio
async def test_text_is_encoded_as_is_and_chat_with_its_template():
    up = Tokenizer()
    t = tokens(up)
    assert await t.tokenize("hi", chat(), False, CALL) == [ord("h"), ord("i")]
    assert await t.tokenize(None, chat(("user", "hi")), True, CALL) == [ord(c) for c in "uhi|A"]
    assert await t.tokenize(None, chat(("user", "hi")), False, CALL) == [ord(c) for c in "uhi|"]
    assert up.seen == [("text", "hi", 8), ("chat", (("user", "hi"),), True), ("chat", (("user", "hi"),), False)]
    assert await t.tokenize("", chat(), False, CALL) == []


@pytest.mark.asyncio
async def test_a_conversation_with_tools_is_counted_as_generate_renders_it():
    """The tools described in the system turn and the earlier calls as JSON turns (the generic
    rendering), exactly the conversation Generate sends the tokenizer; a bad tool is refused the same."""
    up = Tokenizer()
    box = tools.Toolbox((tools.Tool("weather", "d", '{"type": "object"}'),), "required")
    turns = (tools.TurnTools(), tools.TurnTools((tools.ToolCall("call_1", "weather", "{}"),)),
             tools.TurnTools(call_id="call_1"))
    ask = chat(("user", "hi"), ("assistant", ""), ("tool", "sunny"), tools=box, turn_tools=turns)
    limits = Limits(max_context_tokens=100_000, max_prompt_bytes=64_000)
    t = Tokens(Pipeline(up, RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), limits), limits)
    await t.tokenize(None, ask, True, CALL)
    ((_, seen, _),) = up.seen
    assert seen == tools.render(ask).messages and tools.TOOLS_INTRO in seen[0][1] and seen[0][0] == "system"
    with pytest.raises(errors.InvalidInput) as exc:
        await t.tokenize(None, chat(("user", "hi"), tools=tools.Toolbox((tools.Tool("bad name!"),))), True, CALL)
    assert exc.value.reason == "TOOL_INVALID" and len(up.seen) == 1


@pytest.mark.asyncio
async def test_more_tokens_than_the_context_is_refused_with_the_count_never_cut():
    with pytest.raises(errors.InvalidInput) as exc:
        await tokens().tokenize("abcdefghij", chat(), False, CALL)
    assert exc.value.reason == "CONTEXT_LENGTH_EXCEEDED"
    assert exc.value.metadata == {"prompt_tokens": "10", "max_tokens": "0", "context_tokens": "8"}


@pytest.mark.asyncio
@pytest.mark.parametrize("text,messages,reason", [
    ("x" * 65, (), "PROMPT_TOO_LARGE"),
    (None, (), "EMPTY_PROMPT"),
    (None, (("robot", "hi"),), "UNKNOWN_ROLE"),
    (None, (("user", "x" * 65),), "PROMPT_TOO_LARGE"),
])
async def test_the_gateways_prompt_limits_hold(text, messages, reason):
    up = Tokenizer()
    with pytest.raises(errors.InvalidInput) as exc:
        await tokens(up).tokenize(text, chat(*messages), True, CALL)
    assert exc.value.reason == reason and up.seen == []


@pytest.mark.asyncio
async def test_detokenize_keeps_special_tokens_and_refuses_too_many_or_huge_ids():
    up = Tokenizer()
    assert await tokens(up).detokenize([104, 105], CALL) == "hi" and up.seen == [("decode", [104, 105], False)]
    for ids, reason in (([1] * 9, "TOO_MANY_TOKEN_IDS"), ([2**31], "TOKEN_ID_OUT_OF_RANGE")):
        with pytest.raises(errors.InvalidInput) as exc:
            await tokens().detokenize(ids, CALL)
        assert (exc.value.reason, exc.value.metadata["field"]) == (reason, "token_ids")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The servicer over the fake tokenizer, behind the real interceptor and the shipped keys."""
    stage = stage_with(tmp_path_factory.mktemp("gw"), shipped_config())
    with served_gateway(stage, lambda: Pipeline(Tokenizer(), RetryExecutor(RetryConfig(), sleep=no_sleep), LIMITS),
                        LIMITS) as stub:
        yield stub


def reason_of(exc: grpc.RpcError) -> str:
    info = error_details_pb2.ErrorInfo()
    next(d for d in rpc_status.from_call(exc).details if d.Unpack(info))
    return info.reason


KEY = (("x-api-key", "keel-dev-key"),)


def test_over_grpc_with_a_key(gateway):
    resp = gateway.Tokenize(gateway_pb2.TokenizeRequest(text="hi"), metadata=KEY, timeout=10)
    assert list(resp.token_ids) == [104, 105] and resp.context_tokens == 8
    chat = gateway_pb2.ChatMessages(messages=[{"role": "user", "content": "hi"}])
    request = gateway_pb2.TokenizeRequest(chat=chat, add_generation_prompt=True)
    resp = gateway.Tokenize(request, metadata=KEY, timeout=10)
    assert list(resp.token_ids) == [ord(c) for c in "uhi|A"]
    request.tools.add(name="f")
    request.tool_choice.mode = "required"  # the tools described in a system turn first, as Generate does
    with pytest.raises(grpc.RpcError) as exc:  # which the 8-token context cannot hold
        gateway.Tokenize(request, metadata=KEY, timeout=10)
    assert reason_of(exc.value) == "CONTEXT_LENGTH_EXCEEDED"
    request = gateway_pb2.DetokenizeRequest(token_ids=[104, 105])
    assert gateway.Detokenize(request, metadata=KEY, timeout=10).text == "hi"


@pytest.mark.parametrize("call,request_", [
    ("Tokenize", gateway_pb2.TokenizeRequest(text="hi")),
    ("Detokenize", gateway_pb2.DetokenizeRequest(token_ids=[1])),
])
def test_without_a_key_it_is_refused_as_generate_is(gateway, call, request_):
    with pytest.raises(grpc.RpcError) as exc:
        getattr(gateway, call)(request_, timeout=10)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason_of(exc.value) == "MISSING_API_KEY"


def test_bad_input_is_invalid_argument_with_its_reason(gateway):
    with pytest.raises(grpc.RpcError) as exc:
        gateway.Tokenize(gateway_pb2.TokenizeRequest(), metadata=KEY, timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(exc.value) == "EMPTY_PROMPT"
    with pytest.raises(grpc.RpcError) as exc:
        gateway.Tokenize(gateway_pb2.TokenizeRequest(text="abcdefghij"), metadata=KEY, timeout=10)
    assert reason_of(exc.value) == "CONTEXT_LENGTH_EXCEEDED"
