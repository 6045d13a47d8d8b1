"""Property: whatever body, headers and deadline a client sends, the running HTTP stage never
answers 5xx, and every refusal is OpenAI's error object (issue 44). The stage runs in front of a
stand-in gateway that checks keys and answers at once (tests/openai/edge_stage.py), so a 5xx could
only be the stage's own. Bounded: a fixed number of examples, each one request."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.openai.edge_stage import KEY, running

pytestmark = pytest.mark.slow
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "response_format", "echo", "user")
HEADERS = ("authorization", "x-api-key", "traceparent", "tracestate", "content-type",
           "x-forwarded-for", "forwarded", "x-keel-client-address", "x-keel-proxy-token", "expect", "connection")
# Header values http.client will send: no control characters (a bare CR/LF is refused client-side).
VALUE_CHARS = st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_categories=("Cc",))

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
                    st.integers(min_value=10**18, max_value=10**40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner,
                                                 max_size=4)), max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", ""]),
                                           "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
# Well-typed bodies with values anywhere in their types' ranges: these reach the gateway.
plausible = st.fixed_dictionaries(
    {"model": st.text(max_size=10), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": st.text(max_size=30)}),
        min_size=1, max_size=3)},
    optional={"max_tokens": st.integers(), "temperature": st.floats(allow_nan=False, allow_infinity=False),
              "top_p": st.floats(allow_nan=False, allow_infinity=False), "seed": st.integers(),
              "stop": st.lists(st.text(max_size=8), max_size=5), "stream": st.booleans(), "logprobs": st.booleans(),
              "top_logprobs": st.integers(), "n": st.integers(), "user": st.text(max_size=8),
              "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema",
                                                  "json_schema": {"name": "n", "schema": {"type": "object"}}}])})
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"model": st.text(max_size=10), "messages": messages},
                          optional={f: json_values for f in FIELDS[3:]}).map(lambda v: json.dumps(v).encode()),
    plausible.map(lambda v: json.dumps(v).encode()),
    plausible.map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=1, max_value=300).map(lambda n: b'{"model":"m","messages":' + b"[" * n + b"]" * n + b"}"),
)
deadlines = st.one_of(st.integers(min_value=-10, max_value=10**12).map(str), st.text(VALUE_CHARS, max_size=12),
                      st.integers(min_value=1, max_value=500).map(lambda n: "9" * n))
headers = st.dictionaries(st.one_of(st.sampled_from(HEADERS), st.from_regex(r"x-[a-z0-9-]{1,12}", fullmatch=True)),
                          st.one_of(st.text(VALUE_CHARS, max_size=40),
                                    st.integers(min_value=1, max_value=40).map(lambda k: "k" * (k * 512))),
                          max_size=5)
keys = st.sampled_from([{}, {"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}, {"x-api-key": "wrong"}])


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    with running(tmp_path_factory.mktemp("fuzz") / "openai.log") as (url, _):
        yield url


def send(url: str, path: str, body: bytes, hdrs: dict, method: str = "POST",
         timeout_s: float = 30) -> tuple[int, bytes, str]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    try:
        conn.request(method, path, body, hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("content-type") or ""
    finally:
        conn.close()


def short(deadline: str | None) -> bool:
    """A deadline the caller set too short to be met: its 504 is the right answer."""
    return deadline is not None and deadline.isascii() and deadline.isdigit() and int(deadline) < 5000


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=bodies, extra=headers, key=keys,
       deadline=st.one_of(st.none(), st.none(), st.integers(1000, 3_600_000).map(str), deadlines))
def test_never_5xx_and_always_openai_errors(stage, path, body, extra, key, deadline):
    hdrs = {**extra, **key}
    if deadline is not None:
        hdrs["x-keel-deadline-ms"] = deadline
    status, payload, content_type = send(stage, path, body, hdrs)
    assert status < 500 or (status == 504 and short(deadline)), (status, payload[:300])
    if status >= 400:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"], error
    elif "text/event-stream" not in content_type:
        assert json.loads(payload)["choices"]
