"""The stage as its own process (`python -m services.openai`) with no gateway behind it: it serves
its health, answers 503 with a retry hint while the gateway is unreachable, caps the body size,
refuses a bad config with exit 2 naming the field, and stops on SIGTERM (also while an HTTPS client
holds an idle connection)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from keelctl import certs, health
from shared import tls
from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def request(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.fixture(scope="module")
def stage():
    port, dead = free_port(), free_port()
    # a lost gateway is waited for 0.5 s, not the default 10 s (the 503 test would wait it out)
    env = dict(os.environ, KEEL_OPENAI_SERVER__PORT=str(port), KEEL_OPENAI_GATEWAY=f"[127.0.0.1:{dead}]",
               KEEL_OPENAI_SERVER__MAX_MESSAGE_BYTES="2048", KEEL_OPENAI_RECONNECT__READY_S="0.5")
    env.pop("KEEL_MESH_TLS_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        health.wait_serving({"openai": (f"127.0.0.1:{port}", health.HTTP)}, 60, lambda: proc.poll() is None)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()


def test_health_is_serving_without_a_gateway(stage):
    url, _ = stage
    status, _, out = request(f"{url}/health")
    assert (status, out) == (200, {"status": "SERVING"})


@pytest.mark.parametrize("stream", [False, True])
def test_an_unreachable_gateway_is_503_with_retry_after(stage, stream):
    url, _ = stage
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
    status, headers, out = request(f"{url}/v1/chat/completions", body, {"Authorization": "Bearer k"})
    headers = {k.lower(): v for k, v in headers.items()}
    assert status == 503 and out["error"]["code"] == "CONNECTION_LOST"
    assert out["error"]["type"] == "service_unavailable_error"
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "1000"


def test_a_body_over_the_limit_is_413(stage):
    url, _ = stage
    body = json.dumps({"model": "m", "prompt": "x" * 4096}).encode()
    status, _, out = request(f"{url}/v1/completions", body)
    assert status == 413 and out["error"]["code"] == "MESSAGE_TOO_LARGE"


def test_unknown_routes_and_methods_are_openai_errors(stage):
    url, _ = stage
    status, _, out = request(f"{url}/v1/embeddings", b"{}")
    assert status == 404 and out["error"]["code"] == "NOT_FOUND"
    status, _, out = request(f"{url}/v1/models", b"{}")
    assert status == 405 and set(out["error"]) == {"message", "type", "param", "code"}
    status, headers, out = request(f"{url}/v1/chat/completions")
    assert (status, out["error"]["code"], headers["allow"]) == (405, "METHOD_NOT_ALLOWED", "POST")
    assert request(f"{url}/tokenize")[0] == 405


def test_sigterm_stops_it():
    port = free_port()
    env = dict(os.environ, KEEL_OPENAI_SERVER__PORT=str(port), KEEL_OPENAI_GATEWAY=f"[127.0.0.1:{free_port()}]")
    proc = subprocess.Popen([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health.wait_serving({"openai": (f"127.0.0.1:{port}", health.HTTP)}, 60, lambda: proc.poll() is None)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert health.http_status(f"127.0.0.1:{port}") == "DOWN"
    finally:
        proc.kill()


def test_sigterm_stops_it_while_an_https_client_holds_an_idle_connection(tmp_path, monkeypatch):
    """Closing a TLS connection waits for the client's close_notify, which a client holding the
    connection idle (in its pool) does not send: the drain must not wait for it. With a grace of
    300 s (the most allowed), a drain that waited for it would outlast the wait below."""
    folder = certs.make(tmp_path / "certs")
    monkeypatch.setenv(tls.ENV, str(folder))  # the stage serves HTTPS; health.wait_serving asks over it
    port = free_port()
    env = dict(os.environ, KEEL_OPENAI_SERVER__PORT=str(port), KEEL_OPENAI_GATEWAY=f"[127.0.0.1:{free_port()}]",
               KEEL_OPENAI_SERVER__DRAIN_GRACE_S="300")
    proc = subprocess.Popen([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30,
                                       context=ssl.create_default_context(cafile=str(folder / "ca.pem")))
    try:
        health.wait_serving({"openai": (f"127.0.0.1:{port}", health.HTTP)}, 60, lambda: proc.poll() is None)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and not resp.will_close
        resp.read()  # the connection stays open, idle, and this test reads nothing more from it
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        conn.close()
        proc.kill()


def test_a_bad_config_value_exits_2_naming_the_field():
    env = dict(os.environ, KEEL_OPENAI_SERVER__PORT="eighty")
    out = subprocess.run([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "server.port" in out.stderr
