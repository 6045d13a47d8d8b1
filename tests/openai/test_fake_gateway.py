"""The stage's process against a stand-in gateway (grpc, in this test's process) that answers with
what the real gateway serves once generation controls are on: the controls arrive in the gRPC
request, log-probabilities come back in OpenAI's shapes (unary and streamed), the caller's key and
trace context arrive as metadata, adapters are listed, and a failure after a stream has begun is
one `error` event in place of `data: [DONE]`."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from shared import errors, proxyauth
from shared.interceptor import to_status
from shared.modelfile import model_id
from tests.openai.edge_stage import PROXY, client, running

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)

ROOT = Path(__file__).resolve().parents[2]
TRACE = "0af7651916cd43dd8448eb211c80319c"
pytestmark = pytest.mark.slow


def lp(token: str, value: float, *alts) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=token, token_id=len(token), logprob=value, top_logprobs=[
        common_pb2.TopLogprob(token=t, token_id=len(t), logprob=v) for t, v in alts])


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self):
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.metadata: list[dict] = []
        self.cancelled = threading.Event()  # a "hang" call that its caller cancelled

    def _seen(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        context.send_initial_metadata((("x-keel-trace-id", TRACE),))

    def _done(self) -> gateway_pb2.GenerateResponse:
        return gateway_pb2.GenerateResponse(
            text="Hello", trace_id=TRACE, finish_reason="stop", system_fingerprint="00112233aabbccdd",
            adapter="french@2", usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2),
            logprobs=[lp("Hel", -0.5, ("Hel", -0.5), ("Hi", -1.5)), lp("lo", -0.25)])

    def Generate(self, request, context):
        self._seen(request, context)
        if request.text == "long":
            code, message, trailers = to_status(errors.InvalidInput(
                "this model's maximum context length is 2048 tokens, but the request needs 2100: 2000 in the prompt "
                "and 100 to generate", reason="CONTEXT_LENGTH_EXCEEDED",
                metadata={"prompt_tokens": 2000, "max_tokens": 100, "context_tokens": 2048}), TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        if request.chat.messages and request.chat.messages[-1].content == "hang":
            context.add_callback(self.cancelled.set)
            while context.is_active():
                time.sleep(0.05)
        return self._done()

    def GenerateStream(self, request, context):
        self._seen(request, context)
        yield gateway_pb2.GenerateStreamResponse(delta="Hel", logprobs=[lp("Hel", -0.5, ("Hi", -1.5))])
        yield gateway_pb2.GenerateStreamResponse(delta="lo", logprobs=[lp("lo", -0.25)])
        if request.chat.messages[-1].content == "cut":  # gRPC's own status, as when the connection drops
            context.abort(grpc.StatusCode.UNKNOWN, "Stream removed")
        if request.chat.messages[-1].content == "fail":
            code, message, trailers = to_status(errors.NotReady(
                "no inference replica is serving", reason="NO_HEALTHY_UPSTREAM", retry_after_ms=250), TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        yield gateway_pb2.GenerateStreamResponse(done=self._done())

    def Tokenize(self, request, context):
        self._seen(request, context)
        if request.text == "long":
            code, message, trailers = to_status(errors.InvalidInput(
                "the text is 3000 tokens, more than the model's context of 2048", reason="CONTEXT_LENGTH_EXCEEDED",
                metadata={"prompt_tokens": 3000, "max_tokens": 0, "context_tokens": 2048}), TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        text = request.text or "".join(m.content for m in request.chat.messages)
        return gateway_pb2.TokenizeResponse(token_ids=[ord(c) for c in text], context_tokens=2048)

    def Detokenize(self, request, context):
        self._seen(request, context)
        if 99999 in request.token_ids:
            code, message, trailers = to_status(errors.InvalidInput(
                "token id 99999 is outside the vocabulary", reason="TOKEN_ID_OUT_OF_RANGE"), TRACE)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)
        return gateway_pb2.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))

    def ListModels(self, request, context):
        self._seen(request, context)
        return gateway_pb2.ListModelsResponse(adapters=["french@2", "pirate@3"])


@pytest.fixture(scope="module")
def stage():
    with running(None, Gateway()) as served:
        yield served


def test_n_choices_are_n_generations_with_their_own_seeds(stage):
    url, gateway = stage
    before = len(gateway.requests)
    r = client(url).chat.completions.create(model="french@2", messages=[{"role": "user", "content": "hi"}], n=3,
                                            seed=7, temperature=0.8)
    sent = gateway.requests[before:]
    assert sorted(q.sampling.seed for q in sent) == [7, 8, 9] and len(sent) == 3
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == "Hello" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 6, 11)


def test_n_choices_stream_interleaved_each_chunk_naming_its_choice(stage):
    url, _ = stage
    chunks = list(client(url).chat.completions.create(
        model="french@2", messages=[{"role": "user", "content": "hi"}], n=2, stream=True,
        stream_options={"include_usage": True}))
    text = {0: "", 1: ""}
    finished = set()
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.add(choice.index)
    assert text == {0: "Hello", 1: "Hello"} and finished == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize("n", [0, 17])
def test_n_outside_its_range_is_refused_with_its_reason(stage, n):
    url, _ = stage
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).chat.completions.create(model="french@2", messages=[{"role": "user", "content": "hi"}], n=n)
    assert exc.value.code == "N_OUT_OF_RANGE" and exc.value.param == "n"


def test_controls_reach_the_gateway_and_logprobs_come_back(stage):
    url, gateway = stage
    raw = client(url).chat.completions.with_raw_response.create(
        model="french@2", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
        stop=["\n"], response_format={"type": "json_object"}, seed=5,
        extra_headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    r = raw.parse()
    req, md = gateway.requests[-1], gateway.metadata[-1]
    assert (req.adapter, req.sampling.logprobs, req.sampling.top_logprobs, list(req.sampling.stop)) == \
        ("french@2", True, 2, ["\n"])
    assert json.loads(req.response_format.json_schema) == {"type": "object"} and req.sampling.seed == 5
    assert md["authorization"] == "Bearer k-123" and md["traceparent"] == f"00-{TRACE}-00f067aa0ba902b7-01"
    # the caller's address, beside the proxy credential the gateway believes it with
    assert md[proxyauth.CLIENT_HEADER] == "127.0.0.1" and md[proxyauth.HEADER] == PROXY
    assert raw.headers["x-keel-trace-id"] == TRACE and r.model == "french@2"
    content = r.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("Hel", -0.5, [72, 101, 108]),
                                                                ("lo", -0.25, [108, 111])]
    assert [(a.token, a.logprob) for a in content[0].top_logprobs] == [("Hel", -0.5), ("Hi", -1.5)]


def test_completions_logprobs_are_the_legacy_shape(stage):
    url, gateway = stage
    r = client(url).completions.create(model=MODEL_ID, prompt="hi", logprobs=1)
    assert gateway.requests[-1].sampling.top_logprobs == 1 and gateway.requests[-1].adapter == ""
    assert r.choices[0].logprobs.tokens == ["Hel", "lo"] and r.choices[0].logprobs.text_offset == [0, 3]
    assert r.choices[0].logprobs.top_logprobs[0] == {"Hel": -0.5, "Hi": -1.5}


def test_streamed_logprobs_ride_on_their_deltas(stage):
    url, _ = stage
    chunks = list(client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                                      logprobs=True, stream=True))
    with_lp = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert [[t.token for t in c.choices[0].logprobs.content] for c in with_lp] == [["Hel"], ["lo"]]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].system_fingerprint == "00112233aabbccdd"


def test_models_are_the_base_then_the_gateways_adapters(stage):
    url, _ = stage
    assert [m.id for m in client(url).models.list()] == [MODEL_ID, "french@2", "pirate@3"]


@pytest.mark.parametrize("name", [MODEL_ID, "french@2", "pirate"])
def test_one_model_by_its_id(stage, name):
    url, _ = stage
    m = client(url).models.retrieve(name)
    assert (m.id, m.object, m.owned_by) == (name, "model", "keel")


def test_an_unknown_model_is_404_naming_it(stage):
    url, _ = stage
    with pytest.raises(openai.NotFoundError) as exc:
        client(url).models.retrieve("nope@1")
    assert exc.value.body["code"] == "ADAPTER_NOT_FOUND" and exc.value.body["param"] == "model"


def test_a_failure_mid_stream_is_an_error_event_in_place_of_done(stage):
    url, _ = stage
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "fail"}], "stream": True})
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
        assert resp.status == 200
        frames = resp.read().decode().split("\n\n")
    assert frames[-1] == "" and "data: [DONE]" not in frames
    last = json.loads(frames[-2][len("data: "):])
    assert last == {"error": {"message": "no inference replica is serving", "type": "service_unavailable_error",
                              "param": None, "code": "NO_HEALTHY_UPSTREAM"}}
    with pytest.raises(openai.APIError) as exc:
        list(client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "fail"}],
                                                 stream=True))
    assert "no inference replica is serving" in str(exc.value)


def test_a_prompt_beyond_the_context_is_the_sdks_bad_request_with_openais_code(stage):
    url, _ = stage
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).completions.create(model=MODEL_ID, prompt="long", max_tokens=100)
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "prompt")
    assert "2000 in the prompt" in exc.value.message and "100 to generate" in exc.value.message


def post(url: str, path: str, body: dict, key: str | None = "k-123") -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_tokenize_and_detokenize_are_vllms_shapes_over_the_gateway(stage):
    url, gateway = stage
    status, headers, out = post(url, "/tokenize", {"model": MODEL_ID, "prompt": "hi"})
    assert status == 200 and out == {"count": 2, "max_model_len": 2048, "tokens": [104, 105], "token_strs": None}
    assert gateway.requests[-1].text == "hi" and gateway.metadata[-1]["authorization"] == "Bearer k-123"
    assert headers["x-keel-trace-id"] == TRACE
    status, _, out = post(url, "/tokenize", {"messages": [{"role": "user", "content": "yo"}]})
    assert out["tokens"] == [121, 111] and gateway.requests[-1].add_generation_prompt
    assert post(url, "/detokenize", {"tokens": [104, 105]})[2] == {"prompt": "hi"}


@pytest.mark.parametrize("path,body,status,code,param", [
    ("/tokenize", {"prompt": "long"}, 400, "context_length_exceeded", "prompt"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "UNSUPPORTED_PARAMETER", "return_token_strs"),
    ("/tokenize", {"prompt": "hi", "messages": []}, 400, "INVALID_BODY", "(body)"),
    ("/detokenize", {"tokens": [99999]}, 400, "TOKEN_ID_OUT_OF_RANGE", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "TOKEN_ID_OUT_OF_RANGE", "tokens.0"),
    ("/detokenize", {"tokens": "hi"}, 400, "INVALID_BODY", "tokens"),
])
def test_bad_token_requests_are_openai_errors_naming_the_field(stage, path, body, status, code, param):
    url, _ = stage
    got, _, out = post(url, path, body)
    assert (got, out["error"]["code"], out["error"]["param"]) == (status, code, param)


def test_a_dropped_gateway_stream_is_a_keel_reason_not_grpc_text(stage):
    url, _ = stage
    with pytest.raises(openai.APIError) as exc:
        list(client(url).chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "cut"}],
                                                 stream=True))
    assert exc.value.body["code"] == "CONNECTION_LOST" and "Stream removed" not in exc.value.message


def test_what_harms_nothing_reaches_the_gateway_unchanged(stage):
    url, gateway = stage
    r = client(url).chat.completions.create(
        model=MODEL_ID, metadata={"team": "a"}, store=False, user="u-1", service_tier="auto",
        stream_options=None, messages=[{"role": "user", "content": "hi", "name": "ann"},
                                       {"role": "assistant", "content": None, "tool_calls": []},
                                       {"role": "user", "content": "more"}])
    assert r.choices[0].message.content == "Hello"
    assert [(m.role, m.content) for m in gateway.requests[-1].chat.messages] == [
        ("user", "hi"), ("assistant", ""), ("user", "more")]


def test_a_client_that_goes_away_cancels_the_unary_gateway_call(stage):
    url, gateway = stage
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hang"}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 20
        while not (gateway.requests and gateway.requests[-1].chat.messages[-1].content == "hang"):
            assert time.monotonic() < deadline, "the call never reached the gateway"
            time.sleep(0.05)
    assert gateway.cancelled.wait(20)


def test_n_choices_of_a_greedy_answer_are_refused_naming_n(stage):
    url, _ = stage
    with pytest.raises(openai.BadRequestError) as exc:
        client(url).chat.completions.create(model="french@2", messages=[{"role": "user", "content": "hi"}], n=2,
                                            temperature=0)
    assert exc.value.code == "N_WITH_GREEDY" and exc.value.param == "n"
