"""The OpenAI-compatible HTTP API against the running mesh, with the real `openai` client: chat,
streamed chat equal to the unary answer, completions, models, each error class the mesh can be made
to give, W3C trace context, the SSE framing byte for byte (curl), and a client that disconnects
mid-stream cancelling the generation in the inference stage."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import openai
import pytest
from openai import OpenAI

from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id
from testing.mesh import wait_until
from tests.e2e.conftest import THROTTLED_API_KEY
from tests.e2e.test_cancel import value

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ASK = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
UNENDING_STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 6000}},
                  "required": ["story"], "additionalProperties": False}


def client(mesh, key: str = DEV_API_KEY) -> OpenAI:
    # max_retries=0: the SDK would otherwise retry 409/429/5xx itself and hide the status under test
    return OpenAI(base_url=f"http://{mesh.http}/v1", api_key=key, max_retries=0, timeout=300)


def curl(mesh, path: str, *args: str, body: dict | str | None = None, key: str | None = DEV_API_KEY) -> bytes:
    """Debian's curl: the response exactly as it came off the wire (-i: with its headers)."""
    cmd = ["curl", "-sS", "-N", "--max-time", "300", *args]
    if key is not None:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary",
                body if isinstance(body, str) else json.dumps(body)]
    return subprocess.run(cmd + [f"http://{mesh.http}{path}"], capture_output=True, check=True, timeout=320).stdout


def test_chat_answers_with_usage_fingerprint_and_the_trace_id(mesh):
    raw = client(mesh).chat.completions.with_raw_response.create(model=MODEL_ID, messages=ASK, max_tokens=12,
                                                                 temperature=0)
    r = raw.parse()
    trace_id = raw.headers["x-keel-trace-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", trace_id) and r.id == f"chatcmpl-{trace_id}"
    assert r.object == "chat.completion" and r.model == MODEL_ID
    assert "Paris" in r.choices[0].message.content and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert re.fullmatch(r"[0-9a-f]{16}", r.system_fingerprint)
    # the gateway served it: its server span carries the trace id the header named
    wait_until(lambda: any(s["name"] == "gateway/Generate" for s in mesh.spans(trace_id)), 20, "the gateway's span")


def test_a_traceparent_joins_the_callers_trace(mesh):
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    raw = client(mesh).chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=ASK, max_tokens=2, temperature=0,
        extra_headers={"traceparent": f"00-{trace}-{parent}-01"})
    assert raw.headers["x-keel-trace-id"] == trace and raw.parse().id == f"chatcmpl-{trace}"
    spans = wait_until(lambda: [s for s in mesh.spans(trace) if s["name"] == "gateway/Generate"], 20, "the span")
    assert spans[0]["parent_id"] == parent


def test_a_streamed_chat_equals_the_unary_answer(mesh):
    c = client(mesh)
    args = dict(model=MODEL_ID, messages=ASK, max_tokens=16, temperature=0, seed=7)
    unary = c.chat.completions.create(**args)
    chunks = list(c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == unary.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == unary.choices[0].finish_reason
    assert finals[0].system_fingerprint == unary.system_fingerprint
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id != unary.id


def test_completions(mesh):
    r = client(mesh).completions.create(model=MODEL_ID, prompt="Name one colour.", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_ID
    assert r.choices[0].text.strip() and r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 6


def tokens(mesh, text: str) -> list[int]:
    return json.loads(curl(mesh, "/tokenize", body={"prompt": text}))["tokens"]


def test_completions_continue_raw_text_without_the_chat_template(mesh):
    prompt = "def fibonacci(n):"
    r = client(mesh).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(tokens(mesh, prompt))  # the text alone, no template around it
    ids = client(mesh).completions.create(model=MODEL_ID, prompt=tokens(mesh, prompt), max_tokens=8, temperature=0)
    assert ids.choices[0].text == r.choices[0].text  # the same prompt sent as token ids


def test_several_prompts_are_answered_in_order_each_with_n_choices(mesh):
    r = client(mesh).completions.create(model=MODEL_ID, prompt=["One, two,", "Red, green,"], n=2, max_tokens=3,
                                        temperature=0.01, top_p=0.01, seed=5)  # near greedy: n=2 with 0 is refused
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text  # greedy
    alone = client(mesh).completions.create(model=MODEL_ID, prompt="One, two,", max_tokens=3, temperature=0)
    assert r.choices[0].text == alone.choices[0].text
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens + len(tokens(mesh, "Red, green,"))
    with pytest.raises(openai.BadRequestError) as exc:  # a text beside token ids is none of OpenAI's four forms
        client(mesh).completions.create(model=MODEL_ID, prompt=["One, two,", [504]], max_tokens=3)
    assert exc.value.code == "INVALID_BODY" and exc.value.param == "prompt.1"


def test_echo_scores_the_prompt_as_lm_eval_reads_it(mesh):
    """lm-evaluation-harness's request: echo, logprobs 1, max_tokens 1; the prompt's tokens come back
    scored (the first null), then the answer's; max_tokens 0 scores alone; text or ids alike."""
    prompt = "The capital of France is Paris"
    ids = tokens(mesh, prompt)
    c = client(mesh)
    one = c.completions.create(model=MODEL_ID, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = one.choices[0].logprobs
    assert one.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert "".join(lp.tokens[:len(ids)]) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    only = c.completions.create(model=MODEL_ID, prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]  # ids as the text, bit for bit
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL_ID, prompt=prompt, echo=True, max_tokens=1, stream=True)
    assert exc.value.code == "ECHO_UNSUPPORTED"
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=0)
    assert exc.value.code == "MAX_TOKENS_INVALID"
    chat = c.chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = chat.choices[0].model_extra["prompt_logprobs"]  # vLLM's shape: null, then {id: {logprob, ...}}
    assert scored[0] is None and len(scored) == chat.usage.prompt_tokens
    assert all(1 <= len(entry) <= 3 and all(v["logprob"] <= 0 for v in entry.values()) for entry in scored[1:])


def test_models_list_the_base_model(mesh):
    models = client(mesh).models.list()
    ids = [m.id for m in models.data]
    assert ids[0] == MODEL_ID
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9._-]+", i) for i in ids[1:])  # id@version


def test_the_sse_framing_byte_for_byte(mesh):
    """Each event is `data: ` + compact JSON + a blank line; the role opens, the summary closes, then
    `data: [DONE]`. The expected bytes are written out here, not made by the code under test."""
    body = {"model": MODEL_ID, "messages": ASK, "max_tokens": 4, "temperature": 0, "seed": 3, "stream": True}
    out = curl(mesh, "/v1/chat/completions", "-i", body=body)
    head, _, stream = out.partition(b"\r\n\r\n")
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    assert head.startswith(b"HTTP/1.1 200") and headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    trace_id = headers["x-keel-trace-id"]
    created = json.loads(stream.split(b"\n\n")[0][len(b"data: "):])["created"]
    unary = client(mesh).chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=4, temperature=0, seed=3)
    deltas = [json.loads(f[len(b"data: "):])["choices"][0]["delta"].get("content")
              for f in stream.split(b"\n\n")[1:-3]]
    assert "".join(deltas) == unary.choices[0].message.content

    def frame(choice: str, tail: str = "") -> str:
        return (f'data: {{"id":"chatcmpl-{trace_id}","object":"chat.completion.chunk","created":{created},'
                f'"model":"{MODEL_ID}"{tail},"choices":[{choice}]}}\n\n')
    expected = frame('{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}')
    for d in deltas:
        expected += frame(f'{{"index":0,"delta":{{"content":{json.dumps(d, ensure_ascii=False)}}},'
                          '"logprobs":null,"finish_reason":null}')
    expected += frame(f'{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{unary.choices[0].finish_reason}"}}',
                      f',"system_fingerprint":"{unary.system_fingerprint}"')
    expected += "data: [DONE]\n\n"
    assert stream.decode() == expected


@pytest.mark.parametrize("change,status,code,param", [
    ({"temperature": 5}, 400, "TEMPERATURE_OUT_OF_RANGE", "temperature"),
    ({"max_tokens": 5000}, 400, "MAX_TOKENS_TOO_LARGE", "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "UNKNOWN_ROLE", "messages"),
    ({"messages": [{"role": "user", "content": "x" * 40000}]}, 400, "PROMPT_TOO_LARGE", "messages"),
    # one token per digit: 9000 tokens in 9000 bytes, past the model's 8192 and under max_prompt_bytes
    ({"messages": [{"role": "user", "content": "0123456789" * 900}]}, 400, "context_length_exceeded", "messages"),
    ({"model": "no-such-adapter@1"}, 404, "ADAPTER_NOT_FOUND", "model"),
    ({"model": "not/an adapter"}, 400, "INVALID_ADAPTER", "model"),
])
def test_gateway_refusals_keep_their_reason(mesh, change, status, code, param):
    args = {"model": MODEL_ID, "messages": ASK, "max_tokens": 4, **change}
    with pytest.raises(openai.APIStatusError) as exc:
        client(mesh).chat.completions.create(**args)
    err = exc.value
    assert err.status_code == status and err.code == code and err.param == param
    assert set(err.body) >= {"message", "type", "param", "code"} and err.message
    assert re.fullmatch(r"[0-9a-f]{32}", err.response.headers["x-keel-trace-id"])


def test_a_long_prompt_is_cut_only_when_asked_and_then_flagged(mesh):
    long = [{"role": "user", "content": "0123456789" * 900}]
    with pytest.raises(openai.BadRequestError) as exc:
        client(mesh).chat.completions.create(model=MODEL_ID, messages=long, max_tokens=2)
    assert exc.value.code == "context_length_exceeded" and "8192 tokens" in exc.value.message
    r = client(mesh).chat.completions.create(model=MODEL_ID, messages=long, max_tokens=2,
                                             extra_body={"truncate_prompt_tokens": 100})
    assert r.usage.prompt_tokens == 100 and r.model_extra["prompt_truncated"] is True


def test_tokenize_counts_what_a_chat_completion_bills_and_detokenize_reads_it_back(mesh):
    counted = json.loads(curl(mesh, "/tokenize", body={"model": MODEL_ID, "messages": ASK}))
    r = client(mesh).chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=2, temperature=0)
    assert counted["count"] == r.usage.prompt_tokens and counted["max_model_len"] == 8192
    ids = json.loads(curl(mesh, "/tokenize", body={"prompt": "Hello, world"}))["tokens"]
    assert json.loads(curl(mesh, "/detokenize", body={"tokens": ids})) == {"prompt": "Hello, world"}
    assert client(mesh).models.retrieve(MODEL_ID).id == MODEL_ID


def test_unknown_fields_and_wrong_types_are_400_naming_the_field(mesh):
    with pytest.raises(openai.BadRequestError) as exc:
        client(mesh).chat.completions.create(model=MODEL_ID, messages=ASK, extra_body={"bogus": 1})
    assert exc.value.code == "INVALID_BODY" and exc.value.param == "bogus"
    with pytest.raises(openai.BadRequestError) as exc:  # known but not served: not a typo
        client(mesh).chat.completions.create(model=MODEL_ID, messages=ASK, extra_body={"logit_bias": {"42": 5}})
    assert exc.value.code == "UNSUPPORTED_PARAMETER" and exc.value.param == "logit_bias"
    out = curl(mesh, "/v1/chat/completions", "-i", body='{"model": "x", "messages": [')
    assert out.startswith(b"HTTP/1.1 400")
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "INVALID_BODY"
    out = curl(mesh, "/v1/completions", body={"model": MODEL_ID, "prompt": "hi", "max_tokens": "4"})
    assert json.loads(out)["error"] == {"message": "max_tokens: Input should be a valid integer",
                                        "type": "invalid_request_error", "param": "max_tokens", "code": "INVALID_BODY"}


def test_a_bad_or_missing_key_is_401(mesh):
    with pytest.raises(openai.AuthenticationError) as exc:
        client(mesh, "not-a-key").chat.completions.create(model=MODEL_ID, messages=ASK, max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.code == "INVALID_API_KEY"
    out = curl(mesh, "/v1/models", "-i", key=None)
    assert out.startswith(b"HTTP/1.1 401")
    assert json.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "MISSING_API_KEY"


def test_a_rate_limited_key_gets_429_with_retry_after(mesh):
    """The gateway's own per-key limit (1 request, then one per 1000 s): HTTP and gRPC share it."""
    c = client(mesh, THROTTLED_API_KEY)
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(3):  # the first takes the key's one token
            c.models.list()
    err = exc.value
    assert err.status_code == 429 and err.code == "RATE_LIMITED"
    ms = int(err.response.headers["retry-after-ms"])
    assert ms > 0 and int(err.response.headers["retry-after"]) == -(-ms // 1000)


def test_a_deadline_that_runs_out_is_504(mesh):
    with pytest.raises(openai.APIStatusError) as exc:
        client(mesh).chat.completions.create(model=MODEL_ID, messages=LONG, max_tokens=500, temperature=0,
                                             extra_headers={"x-keel-deadline-ms": "400"})
    assert exc.value.status_code == 504 and exc.value.code == "DEADLINE_EXCEEDED"
    with pytest.raises(openai.BadRequestError) as exc:
        client(mesh).models.list(extra_headers={"x-keel-deadline-ms": "soon"})
    assert exc.value.code == "INVALID_HEADER" and exc.value.param == "x-keel-deadline-ms"


def test_health(mesh):
    assert json.loads(curl(mesh, "/health", key=None)) == {"status": "SERVING"}


def test_a_client_that_disconnects_mid_stream_cancels_the_generation(mesh):
    port = mesh.layout["stages"]["inference"]["metrics_ports"][0]
    batch, tokens = "keel_inference_running_batch_size", "keel_inference_generated_tokens"
    cancelled = dict(service="inference", method="Generate", code="CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 30, "an idle inference stage")
    cancelled_before = value(port, "keel_requests", **cancelled)
    body = json.dumps({"model": MODEL_ID, "messages": LONG, "max_tokens": 1000, "stream": True}).encode()
    host, http_port = mesh.http.split(":")
    with socket.create_connection((host, int(http_port)), timeout=300) as s:
        # A deadline the 1000 tokens fit in at any measured pace: admission refuses a request that
        # cannot finish by its deadline (DEADLINE_UNREACHABLE), and this one must run to be cut.
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: keel\r\nAuthorization: Bearer " + DEV_API_KEY.encode()
                  + b"\r\nx-keel-deadline-ms: 3600000"
                  + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while seen.count(b"data: ") < 4:  # the role and three deltas
            chunk = s.recv(65536)
            assert chunk, seen
            seen += chunk
        assert value(port, batch) == 1 or wait_until(lambda: value(port, batch) == 1, 5, "the row in the batch")
    wait_until(lambda: value(port, "keel_requests", **cancelled) == cancelled_before + 1, 30,
               "the inference call to end as CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 10, "the row to leave the batch")
    generated = value(port, tokens)
    time.sleep(2.0)  # the counter is live; a row still generating adds ~10 tokens a second
    assert value(port, tokens) == generated


def test_a_client_that_times_out_on_a_unary_answer_frees_the_model(mesh):
    """The SDK's own timeout closes the connection: the stage cancels its gateway call, the gateway
    its inference call, and the row leaves the batch."""
    port = mesh.layout["stages"]["inference"]["metrics_ports"][0]
    batch = "keel_inference_running_batch_size"
    cancelled = dict(service="inference", method="Generate", code="CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 30, "an idle inference stage")
    cancelled_before = value(port, "keel_requests", **cancelled)
    impatient = OpenAI(base_url=f"http://{mesh.http}/v1", api_key=DEV_API_KEY, max_retries=0, timeout=8)
    with pytest.raises(openai.APITimeoutError):
        # the schema holds the answer open (no end of text before 6000 characters), so on any host
        # the 1000 tokens take longer than the timeout; a sampled story could end within it
        impatient.chat.completions.create(model=MODEL_ID, messages=LONG, max_tokens=1000,
                                          response_format={"type": "json_schema", "json_schema": {
                                              "name": "story", "schema": UNENDING_STORY}},
                                          extra_headers={"x-keel-deadline-ms": "3600000"})  # not refused
    wait_until(lambda: value(port, "keel_requests", **cancelled) == cancelled_before + 1, 30,
               "the inference call to end as CANCELLED")
    wait_until(lambda: value(port, batch) == 0, 10, "the row to leave the batch")
