"""/v1/responses: the stage's process in front of a stand-in gateway, with the real openai SDK:
``responses.create`` with and without a function tool (and the agents SDK's loop of sending the
output and the call's output back), streamed (``responses.stream``), a failure mid-stream as an
``error`` event, and the previous_response_id refusal."""
from __future__ import annotations

import json

import openai
import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from shared import errors
from shared.interceptor import to_status
from tests.openai.edge_stage import client, running
from tests.openai.test_responses import MODEL_ID, TRACE, WEATHER, answer, delta, done, turns

pytestmark = pytest.mark.slow



REFUSALS = {
    "long": errors.InvalidInput("the request needs 3000 tokens, the context is 2048", reason="CONTEXT_LENGTH_EXCEEDED",
                                metadata={"prompt_tokens": 2990, "max_tokens": 10, "context_tokens": 2048}),
    "many": errors.InvalidInput("max_tokens is 5000, the limit is 1024", reason="MAX_TOKENS_TOO_LARGE"),
}


class Gateway(gateway_pb2_grpc.GatewayServicer):
    """Answers "Hello", or calls the first tool when the request has tools and no tool turn yet."""

    def __init__(self):
        self.requests: list[gateway_pb2.GenerateRequest] = []

    def _answer(self, request, context) -> gateway_pb2.GenerateResponse:
        self.requests.append(request)
        context.send_initial_metadata((("x-keel-trace-id", TRACE),))
        if request.chat.messages[-1].content in REFUSALS:  # as the gateway refuses: its own field names
            code, message, trailers = to_status(REFUSALS[request.chat.messages[-1].content], TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        if request.tools and request.chat.messages[-1].role != "tool":
            return answer(text="", finish="tool_calls", calls=[
                common_pb2.ToolCall(id="call_abc", name=request.tools[0].name, arguments='{"city":"Paris"}')])
        return answer()

    def Generate(self, request, context):
        return self._answer(request, context)

    def GenerateStream(self, request, context):
        final = self._answer(request, context)
        for piece in ("Hel", "lo"):
            yield delta(piece)
        if request.chat.messages[-1].content == "fail":
            code, message, trailers = to_status(errors.NotReady(
                "no inference replica is serving", reason="NO_HEALTHY_UPSTREAM", retry_after_ms=250), TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        yield done(final)

    def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse()


@pytest.fixture(scope="module")
def stage():
    with running(None, Gateway()) as served:
        yield served


def test_the_sdks_create_returns_the_text_and_the_trace_id(stage):
    url, gateway = stage
    raw = client(url).responses.with_raw_response.create(model=MODEL_ID, input="hi", instructions="Be brief.",
                                                         max_output_tokens=8)
    r = raw.parse()
    assert raw.headers["x-keel-trace-id"] == TRACE and r.id == f"resp_{TRACE}" and r.output_text == "Hello"
    assert turns(gateway.requests[-1]) == [("system", "Be brief.", [], ""), ("user", "hi", [], "")]
    assert gateway.requests[-1].sampling.max_tokens == 8


def test_the_sdks_function_tool_round_trip(stage):
    url, gateway = stage
    c = client(url)
    first = c.responses.create(model=MODEL_ID, input=[{"role": "user", "content": "weather in Paris?"}],
                               tools=[WEATHER], store=False)
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "weather", {"city": "Paris"})
    assert gateway.requests[-1].tools[0].name == "weather"
    # the agents SDK's loop: the output items back, then the call's output
    second = c.responses.create(model=MODEL_ID, tools=[WEATHER], input=[
        {"role": "user", "content": "weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "Hello"
    assert turns(gateway.requests[-1])[1:] == [("assistant", "", [("call_abc", "weather", '{"city":"Paris"}')], ""),
                                               ("tool", "sunny", [], "call_abc")]


def test_the_sdks_stream_helper_gets_every_event_and_the_final_response(stage):
    url, _ = stage
    with client(url).responses.stream(model=MODEL_ID, input="hi") as stream:
        kinds, deltas = [], []
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(deltas) == final.output_text == "Hello"
    evs = list(client(url).responses.create(model=MODEL_ID, input="hi", stream=True, tools=[WEATHER]))
    assert [e.type for e in evs if e.type.startswith("response.function_call")] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]


def test_a_failure_mid_stream_is_an_error_event(stage):
    url, _ = stage
    evs = list(client(url).responses.create(model=MODEL_ID, input="fail", stream=True))
    assert evs[-1].type == "error" and (evs[-1].code, evs[-1].message) == ("NO_HEALTHY_UPSTREAM",
                                                                          "no inference replica is serving")
    assert not any(e.type == "response.completed" for e in evs)


def test_previous_response_id_is_a_400_naming_it(stage):
    url, _ = stage
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).responses.create(model=MODEL_ID, input="hi", previous_response_id=f"resp_{TRACE}")
    assert (exc.value.code, exc.value.param) == ("UNSUPPORTED_PARAMETER", "previous_response_id")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text,code,param", [("long", "context_length_exceeded", "input"),
                                             ("many", "MAX_TOKENS_TOO_LARGE", "max_output_tokens")])
def test_a_gateway_refusal_names_the_responses_field(stage, stream, text, code, param):
    url, _ = stage
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).responses.create(model=MODEL_ID, input=text, stream=stream)
    assert (exc.value.code, exc.value.param) == (code, param)
