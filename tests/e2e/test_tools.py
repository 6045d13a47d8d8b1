"""Tool calls through the real mesh with the default model (its chat template has no tools section:
the gateway's generic rendering, services/gateway/tools.py): forced calls over many schemas all parse
and validate, a call replays identically, `auto` answers text or a valid call, the openai SDK's parsed
arguments, a streamed call equal to the unary one, and the refusals of what cannot be served, each
naming its field."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id
from tests.e2e.test_controls import assert_replays_identically

# a generation per schema: minutes on a loaded 2-core machine (a minute when it is not)
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL_ID = model_id()
TIMEOUT = 240
MAX_TOKENS = 256  # room for every schema's arguments, up to 4 calls: a call cut short would not parse

STR, INT, NUM, BOOL = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required=None, **more) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **more}


# (name, description, parameters, what the user asks)
TOOLS = [
    ("get_weather", "Current weather in a city", obj({"city": STR}), "What is the weather in Paris?"),
    ("convert_currency", "Convert an amount between currencies",
     obj({"amount": NUM, "from": {"enum": ["USD", "EUR", "GBP"]}, "to": {"enum": ["USD", "EUR", "GBP"]}}),
     "How many euros is 20 dollars?"),
    ("add", "Add two integers", obj({"a": INT, "b": INT}), "What is 2 plus 3?"),
    ("set_alarm", "Set an alarm", obj({"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                       "minute": {"type": "integer", "minimum": 0, "maximum": 59}}),
     "Wake me at 7:30."),
    ("search_web", "Search the web", obj({"query": STR, "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                                         ["query"]), "Search for pictures of cats."),
    ("send_email", "Send an email", obj({"to": STR, "subject": STR, "urgent": BOOL}), "Email bob about lunch."),
    ("create_event", "Create a calendar event",
     obj({"title": STR, "day": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
     "Put a dentist visit on 2025-03-14."),
    ("translate", "Translate a text", obj({"text": STR, "language": {"enum": ["fr", "de", "es"]}}),
     "Translate 'good morning' into French."),
    ("rate_movie", "Rate a movie", obj({"title": STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
     "Give Inception five stars."),
    ("order_pizza", "Order a pizza",
     obj({"size": {"enum": ["small", "medium", "large"]},
          "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "olives"]}, "maxItems": 3}}),
     "Order a large pizza with ham."),
    ("book_flight", "Book a flight",
     obj({"origin": STR, "destination": STR, "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}),
     "Book a flight from Oslo to Rome for two."),
    ("get_stock", "Stock price of a ticker", obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}),
     "What is Apple's stock price?"),
    ("move_robot", "Move the robot",
     obj({"direction": {"enum": ["north", "south", "east", "west"]}, "steps": INT}), "Move the robot 3 steps north."),
    ("turn_on_light", "Switch a light", obj({"room": STR, "on": BOOL}), "Turn on the kitchen light."),
    ("locate", "A point on the map", obj({"position": obj({"lat": NUM, "lon": NUM})}), "Show me 48.8, 2.3 on the map."),
    ("add_contact", "Save a contact",
     {"$defs": {"Phone": obj({"kind": {"enum": ["home", "work"]}, "number": STR})},
      **obj({"name": STR, "phone": {"$ref": "#/$defs/Phone"}})}, "Save Ann's work number 555-1234."),
    ("note", "Write a note", obj({"text": STR, "tags": {"type": "array", "items": STR, "maxItems": 3}}),
     "Note that the milk is out."),
    ("timer", "Start a timer", obj({"seconds": {"type": "integer", "minimum": 1, "maximum": 3600}}),
     "Start a two minute timer."),
    ("set_volume", "Set the volume", obj({"level": {"type": "number", "minimum": 0, "maximum": 1}}),
     "Volume to half."),
    ("find_recipe", "Find a recipe",
     obj({"dish": STR, "vegetarian": BOOL, "max_minutes": {"anyOf": [INT, {"type": "null"}]}}, ["dish", "vegetarian"]),
     "A quick vegetarian curry recipe?"),
    ("lookup_word", "Dictionary lookup", obj({"word": STR}), "What does 'serendipity' mean?"),
    ("no_args", "Report the time", {"type": "object", "properties": {}, "additionalProperties": False},
     "What time is it?"),
]


def tool_pb(name: str, description: str, parameters: dict) -> common_pb2.Tool:
    return common_pb2.Tool(name=name, description=description, parameters=json.dumps(parameters))


def ask(stub, md, tools, question: str, **kw) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content=question)]),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=1), tools=tools, **kw)
    return stub.Generate(req, metadata=md, timeout=TIMEOUT)


def forced(stub, md, k: int) -> list:
    """Schema k's forced call: required over it and the next schema's tool (even k), or it by name (odd
    k) with the next one beside it. The failures: a call that is missing, of the wrong function, or
    whose arguments do not parse or do not validate against its function's schema."""
    name, description, params, question = TOOLS[k]
    other = TOOLS[(k + 1) % len(TOOLS)]
    schemas = {name: params, other[0]: other[2]}
    by_name = k % 2 == 1
    choice = common_pb2.ToolChoice(function=name) if by_name else common_pb2.ToolChoice(mode="required")
    r = ask(stub, md, [tool_pb(name, description, params), tool_pb(*other[:3])], question, tool_choice=choice)
    if r.finish_reason != "tool_calls" or not r.tool_calls or r.text:
        return [(name, r.finish_reason, r.text[:200])]
    failures = []
    for call in r.tool_calls:
        if call.name not in ((name,) if by_name else schemas) or not re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id):
            failures.append((name, "called", call.name, call.id))
            continue
        try:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, call.arguments, str(exc)[:200]))
    return failures


def test_forced_calls_parse_and_validate_over_every_schema(mesh, api_md):
    with grpc.insecure_channel(mesh.gateway) as ch, ThreadPoolExecutor(8) as pool:
        # side by side: the inference stage batches them (a row's tokens are its tokens alone)
        failures = [f for fs in pool.map(lambda k: forced(mesh.stub(ch), api_md, k), range(len(TOOLS))) for f in fs]
    assert not failures, failures


def test_a_tool_call_replays_identically(mesh, api_md):
    name, description, params, question = TOOLS[2]
    with grpc.insecure_channel(mesh.gateway) as ch:
        r = ask(mesh.stub(ch), api_md, [tool_pb(name, description, params)], question,
                tool_choice=common_pb2.ToolChoice(mode="required"))
    assert r.finish_reason == "tool_calls"
    # the record holds the conversation as the model saw it and the calls' grammar (docs/generation.md)
    assert_replays_identically(mesh, r.trace_id)


def test_auto_answers_with_text_or_a_valid_call(mesh, api_md):
    name, description, params, _ = TOOLS[0]
    with grpc.insecure_channel(mesh.gateway) as ch:
        stub = mesh.stub(ch)
        for question in ("What is the weather in Paris?", "Say hello to me."):
            r = ask(stub, api_md, [tool_pb(name, description, params)], question,
                    tool_choice=common_pb2.ToolChoice(mode="auto"))
            if r.tool_calls:
                assert r.finish_reason == "tool_calls" and r.text == "" and r.tool_calls[0].name == name
                jsonschema.validate(json.loads(r.tool_calls[0].arguments), params)
            else:
                assert r.finish_reason == "stop" and r.text and not r.text.startswith('{"response"')


def client(mesh) -> OpenAI:
    # the gateway's deadline as the gRPC calls' (its default, 60 s, is short on a loaded 2-core machine)
    return OpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=300,
                  default_headers={"x-keel-deadline-ms": str(TIMEOUT * 1000)})


class Flight(BaseModel):
    origin: str
    destination: str
    passengers: int


def test_the_sdks_pydantic_tool_gets_parsed_arguments(mesh):
    r = client(mesh).chat.completions.parse(
        model=MODEL_ID, messages=[{"role": "user", "content": "Book a flight from Oslo to Rome for two people."}],
        tools=[openai.pydantic_function_tool(Flight)],
        tool_choice={"type": "function", "function": {"name": "Flight"}}, max_tokens=MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "Flight" and isinstance(call.function.parsed_arguments, Flight)


def test_a_streamed_call_accumulates_to_the_unary_call_and_a_history_answers_it(mesh):
    name, description, params, question = TOOLS[10]
    args = dict(model=MODEL_ID, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                temperature=0, seed=3, tools=[{"type": "function", "function": {
                    "name": name, "description": description, "parameters": params}}], tool_choice="required")
    c = client(mesh)
    unary = c.chat.completions.create(**args).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in c.chat.completions.create(**args, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += d.id or ""
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert unary.finish_reason == finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in unary.message.tool_calls] == [
        (calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]
    assert all(v["id"].startswith("call_") for v in calls.values())
    # the answer's message (as the SDK sends it back) and the call's result, as history, are answered
    # with text under tool_choice none
    after = c.chat.completions.create(
        model=MODEL_ID, max_tokens=24, temperature=0, tools=args["tools"], tool_choice="none",
        messages=[*args["messages"], unary.message,
                  {"role": "tool", "tool_call_id": unary.message.tool_calls[0].id, "content": "Booked: KL1234."}])
    assert after.choices[0].message.content and after.choices[0].message.tool_calls is None


@pytest.mark.parametrize("change, code, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "TOOL_CHOICE_INVALID",
     "tool_choice.function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}]}, "TOOL_INVALID", "tools.0.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "TOOL_INVALID", "tools.0.name"),
    ({"response_format": {"type": "json_object"}}, "TOOLS_CONFLICT", "response_format"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(mesh, change, code, param):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0][2]}}], **change}
    with pytest.raises(openai.BadRequestError) as exc:
        client(mesh).chat.completions.create(**body)
    assert exc.value.status_code == 400
    assert (exc.value.body["code"], exc.value.body["param"]) == (code, param)
