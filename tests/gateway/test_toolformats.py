"""Tool calls in a chat template's own format (services/gateway/toolformats.py, through tools.py):
the Lark grammar of each format accepts exactly the answers tool_choice allows, on the real
vocabulary; the answer is read back into calls or text; and the pipeline sends the tools and the tool
turns to the tokenizer instead of the generic rewrite."""
from __future__ import annotations

import json
import random

import llguidance
import pytest

from keel.tokenizer.v1 import tokenizer_pb2
from services.gateway import tools
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.tools import Tool, Toolbox, ToolCall, TurnTools
from services.gateway.upstreams import MeshUpstreams
from services.gateway.values import Call
from shared import toolformat
from shared.modelfile import source as model_source
from shared.stages import GATEWAY_UPSTREAMS
from testing.upstreams import FakeUpstreams, no_sleep

HERMES, LLAMA3, MISTRAL = toolformat.HERMES, toolformat.LLAMA3, toolformat.MISTRAL
POINT = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                         "additionalProperties": False}},
         "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = (Tool("point", "Place a point", json.dumps(POINT)), Tool("weather", "The weather", json.dumps(WEATHER)))
LIMITS = Limits(max_context_tokens=2048, max_tools=4)


def hermes(*calls: tuple[str, str]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)


def llama(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def mistral(*calls: tuple[str, str], space: str = " ", id_: str = "a1B2c3D4e") -> str:
    """Mistral's calls: v0.3 writes a space after [TOOL_CALLS], Nemo none."""
    body = ", ".join(f'{{"name": "{n}", "arguments": {a}, "id": "{id_}"}}' for n, a in calls)
    return f"[TOOL_CALLS]{space}[{body}]"


@pytest.fixture(scope="module")
def vocab():
    path = model_source().cache_dir / "hf-tokenizer" / "tokenizer.json"
    return llguidance.LLTokenizer(path.read_text(encoding="utf-8"))


def accepts(vocab, box: Toolbox, fmt: str, text: str) -> bool:
    fmt_ = tools.answer_format(box, fmt)
    assert fmt_.kind == "lark"
    m = llguidance.LLMatcher(vocab, llguidance.LLMatcher.grammar_from_lark(fmt_.document), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(vocab.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize("box, fmt, good, bad", [
    (Toolbox(TOOLS, "required"), HERMES,
     [hermes(("weather", '{"city": "Oslo"}')), hermes(("point", '{"p": {"x": 1}}'), ("weather", '{"city": "a"}'))],
     ["It is sunny.", hermes(("weather", '{"town": "Oslo"}')), hermes(("weather", '{"city":"Oslo"}')),
      hermes(("nope", "{}")), hermes(*[("weather", '{"city": "a"}')] * (tools.MAX_PARALLEL_CALLS + 1)), ""]),
    (Toolbox(TOOLS, "auto", parallel=False), HERMES,
     ["It is sunny.", "", hermes(("weather", '{"city": "Oslo"}'))],
     [hermes(("weather", '{"city": "a"}'), ("weather", '{"city": "b"}')), "<tool_call>\nIt is sunny."]),
    (Toolbox(TOOLS, function="point"), HERMES,
     [hermes(("point", '{"p": {"x": 3}}'))],
     [hermes(("weather", '{"city": "Oslo"}')), hermes(("point", '{"p": {"x": 3}}'), ("point", '{"p": {"x": 4}}'))]),
    (Toolbox(TOOLS, "required"), LLAMA3,
     [llama("weather", '{"city": "Oslo"}'), llama("point", '{"p": {"x": -2}}')],
     ["It is sunny.", llama("weather", '{"city": 5}'), '{"name": "weather", "arguments": {"city": "Oslo"}}', ""]),
    (Toolbox(TOOLS), LLAMA3,
     ["It is sunny.", llama("weather", '{"city": "Oslo"}')],
     ['{"name": "weather"}', "{not a call"]),
    (Toolbox(TOOLS, "required"), MISTRAL,
     [mistral(("weather", '{"city": "Oslo"}')), mistral(("weather", '{"city": "Oslo"}'), space=""),
      mistral(("point", '{"p": {"x": 1}}'), ("weather", '{"city": "a"}'))],
     ["It is sunny.", "", mistral(("weather", '{"town": "Oslo"}')),
      mistral(("weather", '{"city": "Oslo"}'), id_="short"),
      mistral(("weather", '{"city": "Oslo"}'), id_="call_1234"), '[TOOL_CALLS] [{"name": "weather", "arguments": '
      '{"city": "Oslo"}}]', mistral(("weather", '{"city": "Oslo"}'), space="  "), "[TOOL_CALLS] []",
      mistral(*[("weather", '{"city": "a"}')] * (tools.MAX_PARALLEL_CALLS + 1))]),
    (Toolbox(TOOLS, "auto", parallel=False), MISTRAL,
     ["It is sunny.", "", mistral(("weather", '{"city": "Oslo"}'))],
     [mistral(("weather", '{"city": "a"}'), ("weather", '{"city": "b"}')), "[TOOL_CALLS] It is sunny."]),
    (Toolbox(TOOLS, function="point"), MISTRAL,
     [mistral(("point", '{"p": {"x": 3}}'))],
     [mistral(("weather", '{"city": "Oslo"}')), mistral(("point", '{"p": {"x": 3}}'), ("point", '{"p": {"x": 4}}'))]),
])
def test_the_grammar_accepts_exactly_the_answers_tool_choice_allows(vocab, box, fmt, good, bad):
    assert all(accepts(vocab, box, fmt, g) for g in good)
    assert not any(accepts(vocab, box, fmt, b) for b in bad)


def test_the_answer_is_read_back_as_calls_or_text():
    read = tools.parse(hermes(("point", '{"p": {"x": 1}}'), ("weather", '{"city": "Å"}')), HERMES)
    assert [(c.name, c.arguments) for c in read.calls] == [("point", '{"p":{"x":1}}'), ("weather", '{"city":"Å"}')]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in read.calls) and read.text == ""
    assert tools.parse(" It is sunny.", HERMES) == tools.Reply(" It is sunny.")
    assert [(c.name, c.arguments) for c in tools.parse(llama("weather", '{"city": "Oslo"}'), LLAMA3).calls] == \
        [("weather", '{"city":"Oslo"}')]
    assert tools.parse("It is sunny.", LLAMA3) == tools.Reply("It is sunny.")
    for cut in ('<tool_call>\n{"name": "weather", "argu', hermes(("weather", "{}")) + " and more",
                "<tool_call>\nnot json\n</tool_call>"):
        assert tools.parse(cut, HERMES) is None
    assert tools.parse('{"name": "weather", "param', LLAMA3) is None


def test_mistral_calls_are_read_back_with_ids_its_template_takes():
    read = tools.parse(mistral(("point", '{"p": {"x": 1}}'), ("weather", '{"city": "Å"}')), MISTRAL)
    assert [(c.name, c.arguments) for c in read.calls] == [("point", '{"p":{"x":1}}'), ("weather", '{"city":"Å"}')]
    # the gateway's own ids (not the one the model wrote), 9 letters and digits
    assert all(toolformat.MISTRAL_ID.fullmatch(c.id) and c.id != "a1B2c3D4e" for c in read.calls)
    assert len({c.id for c in read.calls}) == 2 and read.text == ""
    assert [c.name for c in tools.parse(mistral(("weather", "{}"), space=""), MISTRAL).calls] == ["weather"]
    assert tools.parse("It is sunny.", MISTRAL) == tools.Reply("It is sunny.")
    for cut in ('[TOOL_CALLS] [{"name": "weather", "argu', "[TOOL_CALLS] []", '[TOOL_CALLS] {"name": "weather"}',
                mistral(("weather", "{}")) + " and more", '[TOOL_CALLS] [{"arguments": {}}]'):
        assert tools.parse(cut, MISTRAL) is None


class Templated(FakeUpstreams):
    """Decodes to ``answer`` and keeps what the tokenizer was handed."""

    def __init__(self, answer: str):
        super().__init__()
        self.answer, self.sent, self.generated = answer, [], []

    async def encode_chat(self, messages, max_length, timeout, md, tools=(), turn_tools=(), **_):
        self.sent.append((tuple(messages), tuple(tools), tuple(turn_tools)))
        return await super().encode_chat(messages, max_length, timeout, md)

    async def generate(self, enc, ask, seed, timeout, md):
        self.generated.append(ask.controls.response_format)
        async for ev in super().generate(enc, ask, seed, timeout, md):
            yield ev

    async def decode(self, ids, timeout, md):
        await super().decode(ids, timeout, md)
        return self.answer


def pipeline(up, fmt: str) -> Pipeline:
    return Pipeline(up, RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), LIMITS,
                    rng=random.Random(7), tool_format=fmt)


EARLIER = (("user", "Weather in Oslo?"), ("assistant", ""), ("tool", "sunny"), ("user", "And in Rome?"))
EARLIER_TOOLS = (TurnTools(), TurnTools(calls=(ToolCall("call_1", "weather", '{"city":"Oslo"}'),)),
                 TurnTools(call_id="call_1"), TurnTools())


@pytest.mark.asyncio
async def test_the_template_renders_the_tools_and_the_turns_and_the_call_is_read_back():
    up = Templated(hermes(("weather", '{"city": "Rome"}')))
    box = Toolbox(TOOLS, "required")
    ans = await pipeline(up, HERMES).generate(Ask(EARLIER, 64, tools=box, turn_tools=EARLIER_TOOLS),
                                              Call(1e12, "t" * 32))
    assert ans.finish_reason == "tool_calls" and ans.text == ""
    assert [(c.name, c.arguments) for c in ans.tool_calls] == [("weather", '{"city":"Rome"}')]
    assert up.sent == [(EARLIER, TOOLS, EARLIER_TOOLS)]  # no generic rewrite: the template shows them
    assert up.generated == [tools.answer_format(box, HERMES)]


@pytest.mark.asyncio
async def test_auto_may_answer_text_and_none_shows_no_tools_but_keeps_the_turns():
    up = Templated("It is sunny in Rome.")
    ans = await pipeline(up, LLAMA3).generate(Ask(EARLIER, 64, tools=Toolbox(TOOLS), turn_tools=EARLIER_TOOLS),
                                              Call(1e12, "t" * 32))
    assert ans.finish_reason == "stop" and ans.tool_calls == () and ans.text == "IT IS SUNNY IN ROME."
    up = Templated("Rome is sunny.")
    await pipeline(up, HERMES).generate(Ask(EARLIER, 64, tools=Toolbox(TOOLS, "none"), turn_tools=EARLIER_TOOLS),
                                        Call(1e12, "t" * 32))
    assert up.sent == [(EARLIER, (), EARLIER_TOOLS)] and up.generated == [None]


class CapturingPool:
    """Stands in for the tokenizer pool: hands ``fn`` a stub that keeps the EncodeRequest."""

    def __init__(self):
        self.requests = []

    async def call(self, timeout, fn):
        pool = self

        class Stub:
            async def Encode(self, req, timeout, metadata):
                pool.requests.append(req)
                return tokenizer_pb2.EncodeResponse(input_ids=[1], original_length=1, tool_format=HERMES)
        return await fn(Stub(), timeout)


@pytest.mark.asyncio
async def test_the_encode_request_carries_the_tools_and_each_turns_calls():
    up = MeshUpstreams({stage: ("127.0.0.1:1",) for stage in GATEWAY_UPSTREAMS}, 1 << 20, 1)
    up.pools["tokenizer"] = pool = CapturingPool()
    await up.encode_chat(EARLIER, 64, 5.0, {}, tools=TOOLS, turn_tools=EARLIER_TOOLS)
    chat = pool.requests[0].chat
    assert [(t.name, t.description, t.parameters) for t in chat.tools] == \
        [(t.name, t.description, t.parameters) for t in TOOLS]
    sent = [(r, c, e.call_id) for (r, c), e in zip(EARLIER, EARLIER_TOOLS)]
    assert [(m.role, m.content, m.tool_call_id) for m in chat.messages] == sent
    assert [[(c.id, c.name, c.arguments) for c in m.tool_calls] for m in chat.messages] == \
        [[], [("call_1", "weather", '{"city":"Oslo"}')], [], []]
