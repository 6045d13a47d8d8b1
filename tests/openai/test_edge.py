"""The HTTP stage trusts nothing it should not and never answers 500 (issue 44): forwarded addresses
are believed only from configured proxies; hostile bodies and headers are 400/413/431 naming the
limit, in OpenAI's error shape; slow clients are cut off; a large body waits for a valid key."""
from __future__ import annotations

import http.client
import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from shared import proxyauth
from tests.openai.edge_stage import KEY, running

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
OK_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TIMEOUT_S = 1.0  # the stage's header and body timeouts here


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    log = tmp_path_factory.mktemp("edge") / "openai.log"
    with running(log, edge__header_timeout_s=str(TIMEOUT_S), edge__body_timeout_s=str(TIMEOUT_S)) as (url, gw):
        yield url, gw, log


def post(url: str, body: bytes | dict, headers: dict | None = None, path: str = CHAT):
    """(status, lower-cased headers, JSON) of one request on a fresh connection."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


def assert_openai_error(status, headers, out, expected_status, code):
    assert (status, out["error"]["code"]) == (expected_status, code), out
    assert set(out["error"]) == {"message", "type", "param", "code"}


def connect(url: str) -> socket.socket:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


@pytest.mark.parametrize("key", [None, KEY])
@pytest.mark.parametrize("where", ["top", "field"])
def test_a_body_nested_10000_deep_is_400_naming_the_limit(stage, key, where):
    url, _, _ = stage
    deep = b"[" * 10000 + b"]" * 10000
    body = deep if where == "top" else b'{"model": "m", "messages": [], "user": ' + deep + b"}"
    status, headers, out = post(url, body, {"x-api-key": key} if key else {})
    assert_openai_error(status, headers, out, 400, "INVALID_BODY")
    assert "128 levels" in out["error"]["message"] and headers["x-should-retry"] == "false"


def test_a_json_schema_nested_5000_deep_is_too_large_as_over_grpc(stage):
    url, _, _ = stage
    schema = b'{"type":"object","properties":{"a":' * 5000 + b"{}" + b"}}" * 5000
    body = (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema",'
            b'"json_schema":{"name":"n","schema":' + schema + b"}}}")
    status, headers, out = post(url, body, {"x-api-key": KEY})
    assert_openai_error(status, headers, out, 400, "RESPONSE_FORMAT_TOO_LARGE")
    assert out["error"]["param"] == "response_format.json_schema"
    responses = (b'{"model":"m","input":"hi","text":{"format":{"type":"json_schema","name":"n","schema":' + schema
                 + b"}}}")
    status, headers, out = post(url, responses, {"x-api-key": KEY}, path="/v1/responses")
    assert_openai_error(status, headers, out, 400, "RESPONSE_FORMAT_TOO_LARGE")
    assert out["error"]["param"] == "text.format.schema"


@pytest.mark.parametrize("value", ["9" * 400, "9" * 20, "9" * 309, "3600001", "0", "-5", "1.5", "²", " "])
def test_an_absurd_deadline_is_400(stage, value):
    url, gw, _ = stage
    before = len(gw.seen("Generate"))
    status, headers, out = post(url, OK_BODY, {"x-api-key": KEY, "x-keel-deadline-ms": value})
    assert_openai_error(status, headers, out, 400, "INVALID_HEADER")
    assert out["error"]["param"] == "x-keel-deadline-ms" and "3600000" in out["error"]["message"]
    assert len(gw.seen("Generate")) == before


def test_a_lone_surrogate_in_a_string_is_400(stage):
    url, _, _ = stage
    body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    assert_openai_error(*post(url, body, {"x-api-key": KEY}), 400, "INVALID_BODY")


@pytest.mark.parametrize("size", [5000, 64 * 1024])
def test_an_oversized_key_is_431_without_a_retry_hint(stage, size):
    """It used to reach gRPC's metadata limit: 429 RESOURCE_EXHAUSTED with x-should-retry: true."""
    url, _, _ = stage
    status, headers, out = post(url, OK_BODY, {"x-api-key": "k" * size})
    assert_openai_error(status, headers, out, 431, "HEADER_TOO_LARGE")
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers


def test_a_1mb_header_line_is_refused_without_being_read(stage):
    url, _, _ = stage
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nx-junk: ")
        try:
            for _ in range(16):  # 1 MB in 64 KB pieces; the stage answers partway and drops the rest
                s.sendall(b"a" * 65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "HEADER_TOO_LARGE"


def test_too_many_header_lines_are_431(stage):
    url, _, _ = stage
    with connect(url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: 1\r\n" % i for i in range(100)) + b"\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 431 ")


def test_bytes_that_are_not_http_are_400_in_openai_shape(stage):
    url, _, _ = stage
    with connect(url) as s:
        s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "INVALID_HTTP_REQUEST"


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    """True when the stage closes ``s`` (without an answer) within ``within_s``."""
    s.settimeout(within_s)
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slowloris_connections_are_closed_after_the_header_timeout(stage):
    url, _, _ = stage
    conns = [connect(url) for _ in range(20)]
    try:
        for s in conns:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-slow: 1\r\n")
        start = time.monotonic()
        assert all(closed_by_peer(s, TIMEOUT_S + 5) for s in conns)
        assert time.monotonic() - start < TIMEOUT_S + 5
    finally:
        for s in conns:
            s.close()


def test_a_stalled_body_is_cut_after_the_body_timeout_and_logged_in_one_line(stage):
    url, _, log = stage
    with connect(url) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: " + KEY.encode()
                  + b"\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        assert closed_by_peer(s, TIMEOUT_S + 5)
    time.sleep(0.5)
    text = log.read_text()
    assert "went away while sending its body" in text
    assert "Traceback" not in text and "ClientDisconnect" not in text


@pytest.mark.parametrize("key,code", [(None, "MISSING_API_KEY"), ("wrong", "INVALID_API_KEY")])
def test_a_large_body_without_a_valid_key_is_refused_before_it_is_read(stage, key, code):
    url, _, _ = stage
    with connect(url) as s:
        auth = b"x-api-key: %s\r\n" % key.encode() if key else b""
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
                  + b"Content-Length: 3900000\r\n\r\n")  # the body is never sent
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 401 ") and b"connection: close" in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code


def test_a_large_body_with_a_valid_key_is_served(stage):
    url, gw, _ = stage
    body = {**OK_BODY, "messages": [{"role": "user", "content": "x" * 100_000}]}
    status, _, out = post(url, body, {"authorization": f"Bearer {KEY}"})
    assert status == 200 and out["choices"][0]["message"]["content"] == "ok"
    assert gw.seen("ListModels")[-1]["authorization"] == f"Bearer {KEY}"


def test_a_body_over_the_limit_is_413_before_it_is_read_without_a_retry_hint(stage):
    url, _, _ = stage
    with connect(url) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-api-key: " + KEY.encode()
                  + b"\r\nContent-Length: 99999999\r\n\r\n")
        answer = read_all(s)
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413 ") and b"x-should-retry: false" in head.lower()
    assert b"retry-after" not in head.lower() and json.loads(body)["error"]["code"] == "MESSAGE_TOO_LARGE"


def test_x_forwarded_for_is_not_believed_by_default(stage):
    url, gw, _ = stage
    status, _, _ = post(url, OK_BODY, {"x-api-key": KEY, "X-Forwarded-For": "198.51.100.7"})
    assert status == 200 and gw.seen("Generate")[-1][proxyauth.CLIENT_HEADER] == "127.0.0.1"


def test_x_forwarded_for_is_believed_from_a_configured_proxy(tmp_path):
    with running(tmp_path / "openai.log", trusted_proxies="[127.0.0.1]") as (url, gw):
        status, _, _ = post(url, OK_BODY, {"x-api-key": KEY, "X-Forwarded-For": "198.51.100.7"})
        assert status == 200 and gw.seen("Generate")[-1][proxyauth.CLIENT_HEADER] == "198.51.100.7"
