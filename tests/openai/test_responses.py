"""/v1/responses: every input form lands on the gateway's chat turns and controls, what would need
stored state or a tool Keel does not serve is refused naming the field, and the Response object and
its stream's typed events are what the openai SDK's own models parse (the stage's process with the
real SDK: tests/openai/test_responses_stage.py)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai import body as bodies
from services.openai import responses
from services.openai.responses_schemas import ResponsesBody
from services.openai.schemas import parse
from shared import errors
from shared.modelfile import model_id

MODEL_ID = model_id()
TRACE = "0af7651916cd43dd8448eb211c80319c"
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = common_pb2.ToolCall(id="call_abc", name="weather", arguments='{"city":"Paris"}')


def body(**fields) -> ResponsesBody:
    return parse(ResponsesBody, {"model": MODEL_ID, "input": "hi", **fields})


def request(**fields) -> gateway_pb2.GenerateRequest:
    return responses.request(body(**fields))


def turns(req: gateway_pb2.GenerateRequest) -> list[tuple]:
    return [(m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.tool_call_id)
            for m in req.chat.messages]


def refused(**fields) -> errors.InvalidInput:
    with pytest.raises(errors.InvalidInput) as exc:
        request(**fields)
    return exc.value


def answer(text: str = "Hello", finish: str = "stop", calls=()) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text=text, trace_id=TRACE, finish_reason=finish, adapter="french@2",
                                        usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2),
                                        tool_calls=list(calls))


def finished(r: gateway_pb2.GenerateResponse, **fields) -> Response:
    return Response.model_validate(responses.Reply.start(body(**fields), TRACE).finished(r, responses.has_message(r)))


def streamed(stream: list[gateway_pb2.GenerateStreamResponse], **fields) -> list:
    events = responses.Events(responses.Reply.start(body(**fields), TRACE), MODEL_ID)
    return [EVENT.validate_python(e) for ev in stream for e in events.shaped(ev)]


# --- the request ---


def test_a_string_is_one_user_turn_and_instructions_a_system_turn_first():
    assert turns(request()) == [("user", "hi", [], "")]
    assert turns(request(instructions="Be brief.")) == [("system", "Be brief.", [], ""), ("user", "hi", [], "")]


def test_message_items_in_every_form_are_chat_turns():
    req = request(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        # an earlier answer's output item, sent back as the SDKs send it
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": [], "logprobs": []}]},
        {"role": "system", "content": "sys"}])
    assert turns(req) == [("system", "rules", [], ""), ("user", "ab", [], ""), ("assistant", "c", [], ""),
                          ("system", "sys", [], "")]


def test_function_calls_join_the_assistant_turn_and_their_outputs_are_tool_turns():
    req = request(input=[
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "weather", "arguments": '{"city":"A"}',
         "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"B"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sun"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "function_call", "call_id": "call_3", "name": "weather", "arguments": "{}"}])
    assert turns(req) == [
        ("user", "weather?", [], ""),
        ("assistant", "Looking.", [("call_1", "weather", '{"city":"A"}'), ("call_2", "weather", '{"city":"B"}')], ""),
        ("tool", "sun", [], "call_1"), ("tool", "rain", [], "call_2"),
        ("assistant", "", [("call_3", "weather", "{}")], "")]


def test_sampling_takes_max_output_tokens_and_openais_defaults():
    s = request().sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (0, 1.0, 1.0)
    s = request(max_output_tokens=16, temperature=0.0, top_p=0.5).sampling
    assert (s.max_tokens, s.temperature, s.top_p) == (16, 0.0, 0.5)
    assert refused(max_output_tokens=0).metadata["field"] == "max_output_tokens"
    assert refused(top_p=0).reason == "TOP_P_OUT_OF_RANGE"


@pytest.mark.parametrize("fmt,schema", [
    ({"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}, {"type": "object"}),
    ({"type": "json_object"}, {"type": "object"}),
    ({"type": "text"}, None),
])
def test_text_format_is_the_response_format(fmt, schema):
    req = request(text={"format": fmt})
    assert (json.loads(req.response_format.json_schema) if req.HasField("response_format") else None) == schema


def test_function_tools_tool_choice_and_parallel_calls_reach_the_gateway():
    req = request(tools=[WEATHER, {"type": "function", "name": "now", "strict": True}], tool_choice="required",
                  parallel_tool_calls=False)
    assert [(t.name, t.description, t.strict) for t in req.tools] == [("weather", "the weather in a city", False),
                                                                      ("now", "", True)]
    assert json.loads(req.tools[0].parameters) == WEATHER["parameters"] and req.tools[1].parameters == ""
    assert (req.tool_choice.mode, req.HasField("parallel_tool_calls"), req.parallel_tool_calls) == \
        ("required", True, False)
    req = request(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"})
    assert (req.tool_choice.mode, req.tool_choice.function) == ("", "weather")
    assert not request().HasField("tool_choice") and not request().HasField("parallel_tool_calls")


@pytest.mark.parametrize("fields,field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [WEATHER, {"type": "web_search"}]}, "tools.1.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}]}, "input.1.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
])
def test_what_keel_does_not_serve_is_refused_naming_the_field(fields, field):
    with pytest.raises(errors.InvalidInput) as exc:
        request(**fields)
    assert (exc.value.reason, exc.value.metadata["field"]) == ("UNSUPPORTED_PARAMETER", field)
    if field == "previous_response_id":
        assert "stores no responses" in exc.value.message


@pytest.mark.parametrize("fields,field", [
    ({"temprature": 1}, "temprature"),
    ({"input": [{"role": "robot", "content": "a"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o", "extra": 1}]}, "input.0.extra"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools.0.parameters"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": 3}, "input"),
    ({"input": [3]}, "input.0"),
])
def test_a_malformed_body_is_invalid_body_naming_the_field(fields, field):
    with pytest.raises(errors.InvalidInput) as exc:
        request(**fields)
    assert exc.value.reason == "INVALID_BODY" and exc.value.metadata["field"] == field


def test_what_harms_nothing_is_accepted():
    req = request(metadata={"team": "a"}, user="u", safety_identifier="s", service_tier="auto", store=False,
                  background=False, truncation="disabled", include=[], prompt_cache_key="k",
                  prompt_cache_retention="24h", previous_response_id=None, text={"verbosity": "medium"},
                  stream_options={"include_obfuscation": False}, max_tool_calls=3)
    assert turns(req) == [("user", "hi", [], "")]


def test_a_lone_surrogate_in_an_echoed_field_is_invalid_body():
    data = json.loads('{"model": "m", "input": "hi", "metadata": {"a": "\\ud800"}}')
    with pytest.raises(errors.InvalidInput) as exc:
        bodies.converted(responses.request, parse(ResponsesBody, data))
    assert exc.value.reason == "INVALID_BODY"


FIELDS = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "stream", "store", "previous_response_id", "metadata", "truncation", "include",
          "type", "role", "content", "call_id", "name", "arguments", "output", "format", "schema", "parameters")
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.sampled_from(["function", "message", "function_call", "user",
                                                           "function_call_output", "json_schema", "input_text"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=5)), max_leaves=25)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS[2:16]), json_values, max_size=6), json_values)
def test_any_body_converts_or_is_refused_with_a_reason(fields, value):
    """Property: whatever the JSON, the conversion gives a request whose Response serialises, or an
    InvalidInput with a reason (never another exception: the stage would answer 500)."""
    for data in ({"model": "m", "input": value, **fields}, {"model": "m", **fields, "input": [value]}):
        try:
            b = parse(ResponsesBody, data)
            bodies.converted(responses.request, b)
        except errors.InvalidInput as exc:
            assert exc.reason in ("INVALID_BODY", "UNSUPPORTED_PARAMETER", "MAX_TOKENS_INVALID",
                                  "TOP_P_OUT_OF_RANGE"), exc
            continue
        r = answer(calls=[CALL])
        json.dumps(responses.Reply.start(b, TRACE).finished(r, True), ensure_ascii=False).encode()


# --- the Response object ---


def test_the_response_is_the_sdks_response_with_the_text_and_usage():
    r = finished(answer(), instructions="Be brief.", temperature=0.5, metadata={"team": "a"})
    assert (r.id, r.object, r.status, r.model, r.output_text) == (f"resp_{TRACE}", "response", "completed",
                                                                   "french@2", "Hello")
    (msg,) = r.output
    assert (msg.type, msg.id, msg.role, msg.status, msg.content[0].type) == (
        "message", f"msg_{TRACE}", "assistant", "completed", "output_text")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 2, 7)
    assert (r.instructions, r.temperature, r.top_p, r.store, r.error, r.metadata) == (
        "Be brief.", 0.5, 1.0, False, None, {"team": "a"})
    assert (r.tool_choice, r.tools, r.parallel_tool_calls, r.text.format.type) == ("auto", [], True, "text")


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    r = finished(answer(finish="length"), max_output_tokens=2)
    assert (r.status, r.incomplete_details.reason, r.output[0].status, r.max_output_tokens) == (
        "incomplete", "max_output_tokens", "incomplete", 2)


def test_calls_are_function_call_items_and_echo_the_tools():
    r = finished(answer(text="", finish="tool_calls", calls=[CALL, CALL]), tools=[WEATHER],
                 tool_choice={"type": "function", "name": "weather"})
    assert [(o.type, o.id, o.call_id, o.name, o.arguments, o.status) for o in r.output] == [
        ("function_call", f"fc_{TRACE}_{i}", "call_abc", "weather", '{"city":"Paris"}', "completed") for i in (0, 1)]
    assert r.output_text == "" and r.tools[0].name == "weather" and r.tool_choice.name == "weather"
    with_text = finished(answer(text="Checking.", calls=[CALL]), tools=[WEATHER])
    assert [o.type for o in with_text.output] == ["message", "function_call"]
    assert [o.type for o in finished(answer(text="")).output] == ["message"]  # an empty answer without calls


def test_the_json_schema_format_is_echoed():
    r = finished(answer(), text={"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}})
    assert (r.text.format.type, r.text.format.name, r.text.format.schema_) == ("json_schema", "city",
                                                                              {"type": "object"})


# --- the stream's events ---


def delta(text: str) -> gateway_pb2.GenerateStreamResponse:
    return gateway_pb2.GenerateStreamResponse(delta=text)


def done(r: gateway_pb2.GenerateResponse) -> gateway_pb2.GenerateStreamResponse:
    return gateway_pb2.GenerateStreamResponse(done=r)


def test_a_text_stream_is_the_typed_events_in_order():
    evs = streamed([delta("Hel"), delta(""), delta("lo"), done(answer())])
    assert [e.type for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].response.status == "in_progress" and evs[0].response.output == []
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == evs[6].text == "Hello"
    assert evs[-1].response.output_text == "Hello" and evs[-1].response.usage.total_tokens == 7
    assert {e.item_id for e in evs[3:8]} == {f"msg_{TRACE}"}


def test_a_stream_cut_at_the_limit_ends_incomplete():
    evs = streamed([delta("Hel"), done(answer(finish="length"))])
    assert evs[-1].type == "response.incomplete" and evs[-1].response.incomplete_details.reason == "max_output_tokens"


def test_calls_arrive_with_the_summary_as_function_call_events():
    evs = streamed([done(answer(text="", finish="tool_calls", calls=[CALL]))], tools=[WEATHER])
    assert [e.type for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert (evs[2].item.status, evs[2].item.arguments, evs[3].delta, evs[4].arguments, evs[5].item.arguments) == (
        "in_progress", "", CALL.arguments, CALL.arguments, CALL.arguments)
    assert evs[-1].response.output[0].call_id == "call_abc" and evs[2].output_index == 0


def test_text_only_in_the_summary_still_opens_a_message():
    evs = streamed([done(answer(text="Hi"))])
    assert [e.type for e in evs][2:5] == ["response.output_item.added", "response.content_part.added",
                                          "response.output_text.delta"]
    assert evs[4].delta == "Hi"


def test_a_failure_is_one_error_event():
    events = responses.Events(responses.Reply.start(body(), TRACE), MODEL_ID)
    events.event(delta("Hel"))
    frame = events.failed(errors.NotReady("no inference replica is serving", reason="NO_HEALTHY_UPSTREAM"))
    head, data = frame.decode().removesuffix("\n\n").split("\n")
    ev = EVENT.validate_python(json.loads(data.removeprefix("data: ")))
    assert head == "event: error" and (ev.type, ev.code, ev.sequence_number) == ("error", "NO_HEALTHY_UPSTREAM", 5)
