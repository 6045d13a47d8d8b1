"""OpenAI's function calling at the edge (services/openai/tools.py): tools, tool_choice and a history
with calls land on the gateway's fields; calls come back in OpenAI's message and chunk shapes."""
from __future__ import annotations

import json

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai import convert
from services.openai.schemas import ChatBody, TokenizeBody, parse
from shared import errors
from shared.modelfile import model_id

MODEL_ID = model_id()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather", "parameters": WEATHER,
                                         "strict": True}}
HISTORY = [{"role": "user", "content": "weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def chat(**fields) -> gateway_pb2.GenerateRequest:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}
    return convert.chat_request(parse(ChatBody, body))


def test_tools_and_tool_choice_land_on_the_gateways_fields():
    req = chat(tools=[TOOL, {"type": "function", "function": {"name": "now"}}], tool_choice="required",
               parallel_tool_calls=False)
    assert [(t.name, t.description, t.strict) for t in req.tools] == [("weather", "The weather", True),
                                                                       ("now", "", False)]
    assert json.loads(req.tools[0].parameters) == WEATHER and req.tools[1].parameters == ""
    assert (req.tool_choice.mode, req.tool_choice.function) == ("required", "")
    assert req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    named = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "weather"}})
    assert (named.tool_choice.mode, named.tool_choice.function) == ("", "weather")
    plain = chat(tools=[TOOL])
    assert not plain.HasField("tool_choice") and not plain.HasField("parallel_tool_calls")


def test_a_history_with_calls_and_tool_turns_reaches_the_gateway():
    req = chat(messages=[HISTORY[0], {**HISTORY[1], "refusal": None}, HISTORY[2]])  # as the SDK sends an answer back
    m = req.chat.messages
    assert [(x.role, x.content, x.tool_call_id) for x in m] == [
        ("user", "weather in Oslo?", ""), ("assistant", "", ""), ("tool", "sunny", "call_1")]
    assert [(c.id, c.name, c.arguments) for c in m[1].tool_calls] == [("call_1", "weather", '{"city":"Oslo"}')]


def test_tokenize_carries_a_history_with_calls_as_a_chat_completion_does():
    body = parse(TokenizeBody, {"messages": HISTORY[:2]})
    assert list(convert.tokenize_request(body).chat.messages) == \
        list(chat(messages=HISTORY[:2]).chat.messages)


@pytest.mark.parametrize("fields, field", [
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools.0.function.parameters"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_a_malformed_tool_field_is_refused_naming_it(fields, field):
    with pytest.raises(errors.InvalidInput) as exc:
        chat(**fields)
    assert exc.value.reason == "INVALID_BODY" and exc.value.metadata["field"].startswith(field)


def calls_answer(**kw) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        finish_reason="tool_calls", trace_id="t" * 32, usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=9),
        tool_calls=[common_pb2.ToolCall(id="call_a", name="weather", arguments='{"city":"Oslo"}'),
                    common_pb2.ToolCall(id="call_b", name="now", arguments="{}")], **kw)


def test_a_unary_answer_carries_the_calls_with_null_content():
    out = convert.answer(convert.Reply.start(True, "t" * 32), [calls_answer()], False)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    text = convert.answer(convert.Reply.start(True, "t" * 32), [gateway_pb2.GenerateResponse(text="hi")], False)
    assert text["choices"][0]["message"] == {"role": "assistant", "content": "hi", "refusal": None}


def test_a_stream_carries_the_calls_as_one_delta_before_its_finish():
    shaper = convert.StreamShaper(convert.Reply.start(True, "t" * 32), MODEL_ID, False, False)
    chunks = shaper.event(gateway_pb2.GenerateStreamResponse(done=calls_answer()))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}
    assert deltas[2] == {} and chunks[2]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_streamed_answer_sent_whole_gets_its_text_once():
    whole = convert.StreamShaper(convert.Reply.start(True, "t" * 32), MODEL_ID, False, False)
    chunks = whole.event(gateway_pb2.GenerateStreamResponse(done=gateway_pb2.GenerateResponse(
        text="it is sunny", finish_reason="stop")))
    assert [c["choices"][0]["delta"] for c in chunks][1:] == [{"content": "it is sunny"}, {}]
    streamed = convert.StreamShaper(convert.Reply.start(True, "t" * 32), MODEL_ID, False, False)
    streamed.event(gateway_pb2.GenerateStreamResponse(delta="it is sunny"))
    chunks = streamed.event(gateway_pb2.GenerateStreamResponse(done=gateway_pb2.GenerateResponse(
        text="it is sunny", finish_reason="stop")))
    assert [c["choices"][0]["delta"] for c in chunks] == [{}]
