"""OpenAI's Responses API (/v1/responses) against the running mesh, with the real `openai` client: a
string input answers with its text and the trace id, instructions are a system turn the model sees,
a stream's deltas join to its final text (and to the unary answer), a json_schema text format gives
JSON valid under the schema, a function tool is called, and previous_response_id is refused."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest
from openai import OpenAI

from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)
ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
# Whether the gateway answers tool calls yet (GenerateResponse.tool_calls): its code names the field.
GATEWAY_CALLS_TOOLS = any("tool_calls" in p.read_text() for p in (ROOT / "services" / "gateway").glob("*.py"))

# A call decoded under the tools' grammar takes longer than the gateway's default deadline on a busy CPU.
PATIENT = {"x-keel-deadline-ms": "600000"}

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def client(mesh) -> OpenAI:
    return OpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=300)


def test_a_string_input_answers_with_its_text_and_the_trace_id(mesh):
    raw = client(mesh).responses.with_raw_response.create(model=MODEL_ID, input=QUESTION, max_output_tokens=12,
                                                          temperature=0)
    r = raw.parse()
    trace_id = raw.headers["x-keel-trace-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id) and r.id == f"resp_{trace_id}"
    assert (r.object, r.model, r.store, r.output[0].type) == ("response", MODEL_ID, False, "message")
    assert "Paris" in r.output_text and r.status in ("completed", "incomplete")
    assert 0 < r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_instructions_are_a_system_turn_first(mesh):
    """The prompt the model saw is the conversation [system: instructions, user: input], counted by
    /tokenize (the same chat template as a generation)."""
    instructions = "You are a geography teacher. Answer with one word."
    r = client(mesh).responses.create(model=MODEL_ID, input=QUESTION, max_output_tokens=4, temperature=0,
                                      instructions=instructions)
    conversation = [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}]
    req = urllib.request.Request(f"http://{mesh.http}/tokenize", data=json.dumps({"messages": conversation}).encode(),
                                 headers={"Authorization": f"Bearer {DEV_API_KEY}", "Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as resp:
        counted = json.loads(resp.read())
    assert r.instructions == instructions and r.output_text
    assert r.usage.input_tokens == counted["count"]


def test_a_stream_joins_to_its_final_text_and_the_unary_answer(mesh):
    c = client(mesh)
    args = dict(model=MODEL_ID, input=[{"role": "user", "content": QUESTION}], max_output_tokens=16, temperature=0)
    unary = c.responses.create(**args)
    with c.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e.text for e in events if e.type == "response.output_text.done"]
    assert deltas and done == [deltas] == [unary.output_text]
    if kinds[-1] == "response.completed":
        assert final.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_json_schema_format_gives_json_valid_under_it(mesh):
    r = client(mesh).responses.create(
        model=MODEL_ID, input="Which city is the capital of France? Answer in JSON.", max_output_tokens=64,
        temperature=0, text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_previous_response_id_is_a_400_naming_it(mesh):
    with pytest.raises(openai.BadRequestError) as exc:
        client(mesh).responses.create(model=MODEL_ID, input="and then?", previous_response_id="resp_0")
    assert (exc.value.code, exc.value.param) == ("UNSUPPORTED_PARAMETER", "previous_response_id")
    assert "stores no responses" in exc.value.message


@pytest.mark.skipif(not GATEWAY_CALLS_TOOLS, reason="the gateway does not answer tool calls yet "
                                                    "(GenerateResponse.tool_calls is never filled)")
def test_a_function_tool_is_called_and_its_output_answered(mesh):
    c = client(mesh)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.responses.create(model=MODEL_ID, input=ask, tools=[WEATHER], tool_choice="required", temperature=0,
                               parallel_tool_calls=False, max_output_tokens=64, extra_headers=PATIENT)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = c.responses.create(model=MODEL_ID, tools=[WEATHER], tool_choice="none", temperature=0,
                                max_output_tokens=32, extra_headers=PATIENT, input=[
        *ask, *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert second.output_text and second.output[0].type == "message"
