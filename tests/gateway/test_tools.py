"""Tool calls in the gateway (services/gateway/tools.py): the grammar built from the tools and
tool_choice, the refusals, llama.cpp's generic rendering, reading the answer back, and the pipeline
and servicer hooks, against the scripted in-process upstreams."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.replay import request_of
from services.feedback.records import ReplayRecord, stored_body
from services.feedback.servicer import record_from_proto
from services.gateway import tools
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.recording import to_record
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.servicer import to_ask, to_response
from services.gateway.tools import Tool, Toolbox, ToolCall, TurnTools
from services.gateway.values import Answer, Call, Delta
from shared import errors
from shared.controls import Controls, ResponseFormat
from testing.upstreams import FakeUpstreams, no_sleep

POINT = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                         "additionalProperties": False}},
         "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (Tool("point", "Place a point", json.dumps(POINT)), Tool("weather", "The weather in a city",
                                                                   json.dumps(WEATHER)))
GOOD_POINT = {"name": "point", "arguments": {"p": {"x": 1}}}
GOOD_WEATHER = {"name": "weather", "arguments": {"city": "Oslo"}}
LIMITS = Limits(max_context_tokens=2048, max_tools=4)


def ask(box: Toolbox | None = None, messages=(("user", "hello"),), **kw) -> Ask:
    return Ask(messages=messages, max_tokens=8, tools=box, **kw)


def valid(box: Toolbox, answer: dict) -> bool:
    return jsonschema.Draft202012Validator(json.loads(tools.grammar(box))).is_valid(answer)


@pytest.mark.parametrize("box, good, bad", [
    (Toolbox(TOOLS, "required"), [{"tool_calls": [GOOD_POINT, GOOD_WEATHER]}],
     [{"response": "hi"}, {"tool_calls": []}, {"tool_calls": [GOOD_WEATHER] * (tools.MAX_PARALLEL_CALLS + 1)},
      {"tool_calls": [{"name": "point", "arguments": {"p": {"x": "1"}}}]},
      {"tool_calls": [{"name": "nope", "arguments": {}}]}, {"tool_call": GOOD_POINT}]),
    (Toolbox(TOOLS), [{"tool_calls": [GOOD_WEATHER]}, {"response": "hi"}],
     [{"response": 1}, {"response": "hi", "tool_calls": [GOOD_WEATHER]}, {"tool_calls": [{"name": "weather",
                                                                                         "arguments": {}}]}]),
    (Toolbox(TOOLS, function="point"), [{"tool_call": GOOD_POINT}],
     [{"tool_call": GOOD_WEATHER}, {"response": "hi"}, {"tool_calls": [GOOD_POINT]}]),
    (Toolbox(TOOLS, "auto", parallel=False), [{"tool_call": GOOD_WEATHER}, {"response": "x"}],
     [{"tool_calls": [GOOD_WEATHER]}, {"tool_call": {**GOOD_POINT, "extra": 1}}]),
])
def test_the_grammar_accepts_exactly_the_calls_tool_choice_allows(box, good, bad):
    assert all(valid(box, g) for g in good)
    assert not any(valid(box, b) for b in bad)
    # the grammar engine the inference stage runs compiles it
    compiled = llguidance.LLMatcher.grammar_from_json_schema(tools.grammar(box),
                                                             overrides={"whitespace_flexible": False})
    assert llguidance.LLMatcher.validate_grammar(compiled) == ""


def test_a_tools_own_id_and_schema_keys_do_not_move_its_refs():
    schema = {**POINT, "$id": "https://example.com/point", "$schema": "https://json-schema.org/draft/2020-12/schema"}
    box = Toolbox((Tool("point", "", json.dumps(schema)),), "required")
    assert valid(box, {"tool_calls": [GOOD_POINT]})
    assert not valid(box, {"tool_calls": [{"name": "point", "arguments": {"p": {"x": 1.5}}}]})


@pytest.mark.parametrize("box, kw, reason, field", [
    (Toolbox((Tool("bad name"),)), {}, "TOOL_INVALID", "tools.0.name"),
    (Toolbox((Tool("a" * 65),)), {}, "TOOL_INVALID", "tools.0.name"),
    (Toolbox((Tool("a"), Tool("a"))), {}, "TOOL_INVALID", "tools.1.name"),
    (Toolbox((Tool("a", "", "{not json"),)), {}, "TOOL_INVALID", "tools.0.parameters"),
    (Toolbox((Tool("a", "", "[]"),)), {}, "TOOL_INVALID", "tools.0.parameters"),
    (Toolbox((Tool("a", "", '{"type": "strin"}'),)), {}, "TOOL_INVALID", "tools.0.parameters"),
    (Toolbox((Tool("a", "", '{"type": "string"}'),)), {}, "TOOL_INVALID", "tools.0.parameters"),
    (Toolbox(tuple(Tool(f"t{i}") for i in range(5))), {}, "TOO_MANY_TOOLS", "tools"),
    (Toolbox(TOOLS, function="nope"), {}, "TOOL_CHOICE_INVALID", "tool_choice.function"),
    (Toolbox(TOOLS, "sometimes"), {}, "TOOL_CHOICE_INVALID", "tool_choice.mode"),
    (Toolbox(TOOLS, "auto", function="point"), {}, "TOOL_CHOICE_INVALID", "tool_choice.mode"),
    (Toolbox((), "required"), {}, "TOOL_CHOICE_INVALID", "tool_choice.mode"),
    (Toolbox(TOOLS), {"controls": Controls(response_format=ResponseFormat("regex", "a+"))},
     "TOOLS_CONFLICT", "response_format"),
    (Toolbox(TOOLS), {"messages": ()}, "TOOLS_CONFLICT", "tools"),
    (Toolbox((Tool("big", "", json.dumps({"type": "object", "description": "x" * 20000})),)), {},
     "TOOLS_TOO_LARGE", "tools"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(box, kw, reason, field):
    with pytest.raises(errors.InvalidInput) as exc:
        tools.check(ask(box, **kw), LIMITS)
    assert exc.value.reason == reason and exc.value.metadata["field"] == field


def test_tool_choice_none_serves_response_format_and_ignores_the_tools():
    fmt = ResponseFormat("regex", "a+")
    a = ask(Toolbox(TOOLS, "none"), controls=Controls(response_format=fmt))
    tools.check(a, LIMITS)
    rendered = tools.render(a)
    assert rendered.messages == (("user", "hello"),) and rendered.controls.response_format == fmt


def test_the_tools_are_appended_to_the_system_turn_or_open_the_conversation():
    box = Toolbox(TOOLS)
    text = tools.system_text(box)
    assert text.startswith("Respond in JSON format, either with `tool_calls` (a request to call tools) or with "
                           "`response` reply to the user's request\n\nYou can call any of the following tools")
    assert text.endswith('Example tool call syntax:\n\n{"tool_calls":[{"name":"tool_name","arguments":'
                         '{"arg1":"some_value"}}]}')
    shown = json.loads(text.split(tools.TOOLS_INTRO, 1)[1].split("\n\nExample", 1)[0])
    assert shown[1] == {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                         "parameters": WEATHER}}
    alone = tools.render(ask(box))
    assert alone.messages == (("system", text), ("user", "hello"))
    assert alone.controls.response_format == ResponseFormat("json_schema", tools.grammar(box))
    joined = tools.render(ask(box, messages=(("system", "Be brief."), ("user", "hello"))))
    assert joined.messages == (("system", "Be brief.\n" + text), ("user", "hello"))
    forced = tools.system_text(Toolbox(TOOLS, function="point"))
    assert forced.startswith("Respond in JSON format with `tool_call` (a request to call tools)\n\n")


def test_earlier_calls_and_tool_turns_are_rendered_as_json_turns_of_the_tokenizers_roles():
    messages = (("user", "weather?"), ("assistant", ""), ("tool", "sunny"), ("tool", "orphan"))
    turns = (TurnTools(), TurnTools((ToolCall("call_1", "weather", '{"city": "Oslo"}'),)),
             TurnTools(call_id="call_1"), TurnTools(call_id="call_x"))
    for box, calls in ((Toolbox(TOOLS, "none"), '{"tool_calls":[{"name":"weather","arguments":{"city":"Oslo"}}]}'),
                       (Toolbox(TOOLS, "none", parallel=False),
                        '{"tool_call":{"name":"weather","arguments":{"city":"Oslo"}}}')):
        rendered = tools.render(ask(box, messages=messages, turn_tools=turns))
        assert rendered.messages == (
            ("user", "weather?"), ("assistant", calls),
            ("user", '{"tool_response":{"tool_call_id":"call_1","name":"weather","content":"sunny"}}'),
            ("user", '{"tool_response":{"tool_call_id":"call_x","content":"orphan"}}'))
        assert rendered.turn_tools == () and rendered.controls.response_format is None


def test_the_generated_json_is_read_back_as_text_or_calls_with_new_ids():
    assert tools.parse('{"response":"Hi there"}') == tools.Reply("Hi there")
    reply = tools.parse('{"tool_calls":[{"name":"weather","arguments":{"city":"Oslo"}},'
                        '{"name":"point","arguments":{"p":{"x":1}}}]}')
    assert [(c.name, c.arguments) for c in reply.calls] == [("weather", '{"city":"Oslo"}'), ("point", '{"p":{"x":1}}')]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in reply.calls)
    assert reply.calls[0].id != reply.calls[1].id
    assert tools.parse('{"tool_call":{"name":"weather","arguments":{}}}').calls[0].arguments == "{}"
    for cut in ('{"tool_calls":[{"name":"weather","argu', "[]", '{"tool_call":{"arguments":{}}}', ""):
        assert tools.parse(cut) is None


class Scripted(FakeUpstreams):
    """Decodes to ``answer`` and keeps what the tokenizer and the validator were given."""

    def __init__(self, answer: str, refuse: errors.InvalidInput | None = None):
        super().__init__()
        self.answer, self.refuse, self.encoded, self.seen = answer, refuse, [], []

    async def encode_chat(self, messages, max_length, timeout, md, **_):
        self.encoded.append(tuple(messages))
        return await super().encode_chat(messages, max_length, timeout, md)

    async def generate(self, enc, ask, seed, timeout, md):
        if self.refuse is not None:
            raise self.refuse
        async for ev in super().generate(enc, ask, seed, timeout, md):
            yield ev

    async def decode(self, ids, timeout, md):
        await super().decode(ids, timeout, md)
        return self.answer

    async def validate_output(self, text, ask, entropies, timeout, md):
        self.seen.append((text, ask.controls.response_format))
        return await super().validate_output(text, ask, entropies, timeout, md)


def pipeline(up, served=None) -> Pipeline:
    return Pipeline(up, RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1)), LIMITS,
                    rng=random.Random(7), on_served=served)


@pytest.mark.asyncio
async def test_a_call_is_answered_as_tool_calls_and_validated_as_its_json():
    raw = '{"tool_calls":[{"name":"weather","arguments":{"city":"Oslo"}}]}'
    up, served = Scripted(raw), []
    ans = await pipeline(up, served.append).generate(ask(Toolbox(TOOLS, "required")), Call(1e12, "t" * 32))
    assert ans.text == "" and ans.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in ans.tool_calls] == [("weather", '{"city":"Oslo"}')]
    assert up.encoded[0][0][0] == "system" and tools.TOOLS_INTRO in up.encoded[0][0][1]
    assert up.seen == [(raw, ResponseFormat("json_schema", tools.grammar(Toolbox(TOOLS, "required"))))]
    record = to_record(served[0], 1)  # the request as sent, not as rendered, and the answer's calls
    assert [(m.role, m.content) for m in record.messages] == [("user", "hello")]
    assert not record.HasField("response_format") and [t.name for t in record.tools] == ["point", "weather"]
    assert record.tool_choice.mode == "required" and record.parallel_tool_calls
    assert [(c.id, c.name) for c in record.tool_calls] == [(ans.tool_calls[0].id, "weather")]


@pytest.mark.asyncio
async def test_a_response_is_answered_as_text_and_validated_without_the_grammar():
    up = Scripted('{"response":"it is sunny"}')
    ans = await pipeline(up).generate(ask(Toolbox(TOOLS)), Call(1e12, "t" * 32))
    assert ans.text == "IT IS SUNNY" and ans.tool_calls == () and ans.finish_reason == "stop"
    assert up.seen == [("it is sunny", None)]


@pytest.mark.asyncio
async def test_a_stream_with_tools_sends_the_calls_whole_with_its_answer():
    up = Scripted('{"tool_call":{"name":"point","arguments":{"p":{"x":2}}}}')
    items = [i async for i in pipeline(up).stream(ask(Toolbox(TOOLS, function="point")), Call(1e12, "t" * 32))]
    assert len(items) == 1 and not isinstance(items[0], Delta)
    assert [(c.name, c.arguments) for c in items[0].tool_calls] == [("point", '{"p":{"x":2}}')]


@pytest.mark.asyncio
async def test_the_engines_refusal_of_a_tools_schema_names_the_tool():
    refused = errors.InvalidInput("response_format.json_schema does not compile: Unimplemented keys: [\"not\"]",
                                  reason="RESPONSE_FORMAT_INVALID", metadata={"field": "response_format.json_schema"})
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(Scripted("", refused)).generate(ask(Toolbox(TOOLS, function="weather")), Call(1e12, "t" * 32))
    assert exc.value.reason == "TOOL_INVALID" and exc.value.metadata["field"] == "tools.1.parameters"
    assert "Unimplemented keys" in exc.value.message
    with pytest.raises(errors.InvalidInput) as exc:
        await pipeline(Scripted("", refused)).generate(ask(Toolbox(TOOLS)), Call(1e12, "t" * 32))
    assert exc.value.reason == "TOOL_INVALID" and exc.value.metadata["field"] == "tools"


@pytest.mark.asyncio
async def test_a_tool_request_refused_by_the_gateway_is_quarantined():
    up = Scripted("")
    with pytest.raises(errors.InvalidInput):
        await pipeline(up).generate(ask(Toolbox(TOOLS, function="nope")), Call(1e12, "t" * 32))
    assert [r for r, _ in up.quarantined] == ["TOOL_CHOICE_INVALID"] and "generate" not in up.calls


def test_the_servicer_carries_tools_and_calls_both_ways():
    req = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="hi"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(id="call_1", name="weather",
                                                                                     arguments="{}")]),
            common_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]),
        tools=[common_pb2.Tool(name="weather", description="d", parameters="{}", strict=True)],
        tool_choice=common_pb2.ToolChoice(mode="required"), parallel_tool_calls=False)
    a = to_ask(req, LIMITS)
    assert a.tools == Toolbox((Tool("weather", "d", "{}", True),), "required", "", False)
    assert a.turn_tools == (TurnTools(), TurnTools((ToolCall("call_1", "weather", "{}"),)), TurnTools(call_id="call_1"))
    assert to_ask(gateway_pb2.GenerateRequest(prompt="x"), LIMITS).tools is None
    assert to_ask(gateway_pb2.GenerateRequest(prompt="x"), LIMITS).turn_tools == ()
    out = to_response(Answer(finish_reason="tool_calls", tool_calls=(ToolCall("call_2", "weather", '{"a":1}'),)))
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [("call_2", "weather", '{"a":1}')]



@pytest.mark.asyncio
async def test_a_replay_of_a_tool_request_renders_the_same_conversation_and_grammar():
    """gateway record -> the feedback stage's stored JSON -> keel replay's request -> the gateway again:
    the tools, tool_choice and the turns' calls survive, so the model sees the same prompt."""
    req = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="weather in Oslo?"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(
                id="call_1", name="weather", arguments='{"city":"Oslo"}')]),
            common_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]),
        tools=[common_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in TOOLS],
        tool_choice=common_pb2.ToolChoice(function="weather"), parallel_tool_calls=False)
    raw = '{"tool_call":{"name":"weather","arguments":{"city":"Bergen"}}}'
    first, served = Scripted(raw), []
    await pipeline(first, served.append).generate(to_ask(req, LIMITS), Call(1e12, "t" * 32))
    kept = ReplayRecord.from_body(stored_body(record_from_proto(to_record(served[0], 1)), True))
    assert kept.tool_use["tool_calls"][0]["name"] == "weather"
    again = request_of(kept)
    assert (list(again.tools), again.tool_choice, again.parallel_tool_calls) == \
        (list(req.tools), req.tool_choice, False)
    assert list(again.chat.messages) == list(req.chat.messages)
    second = Scripted(raw)
    await pipeline(second).generate(to_ask(again, LIMITS), Call(1e12, "u" * 32))
    assert second.encoded == first.encoded and second.seen == first.seen
    assert ReplayRecord.from_body(stored_body(record_from_proto(to_record(served[0], 1)), False)).tool_use is None
