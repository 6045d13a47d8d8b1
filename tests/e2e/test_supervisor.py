"""kill -9 each stage under `keel up`: it comes back SERVING, the restart is logged, the next
request is answered. Uses its own mesh so the other end-to-end tests see an undisturbed one."""
from __future__ import annotations

import os
import signal

import grpc
import pytest

from keelctl import health
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh, wait_until
from tests.e2e.conftest import SERVICES
from tests.e2e.test_openai import ASK, client

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def own_mesh(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("kill9"), tokenizer_workers=1)  # killing the one process kills the stage
    yield m
    stop_mesh(m)


@pytest.mark.parametrize("stage", ["tokenizer", "inference", "validator", "gateway", "redis"])
def test_kill9_stage_is_restarted_and_serves_again(own_mesh, stage, api_md, gateway_request):
    mesh = own_mesh
    name = f"{stage}-0.0" if stage != "redis" else "redis"
    old_pid = mesh.state()["processes"][name]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted():
        p = mesh.state()["processes"][name]
        return p["pid"] if p["pid"] != old_pid else None
    new_pid = wait_until(restarted, 5, f"{name} restarted")
    assert new_pid != old_pid
    if stage != "redis":
        health.wait_serving({name: (f"127.0.0.1:{mesh.ports[stage][0]}", SERVICES[stage])}, 120)
    logged = [r for r in mesh.log("supervisor") if r.get("stage") == name and r["msg"] == "stage exited; restarting"]
    assert logged and logged[-1]["signal"] == signal.SIGKILL
    mesh.wait_serving(120)
    with grpc.insecure_channel(mesh.gateway) as ch:
        resp = mesh.stub(ch).Generate(gateway_request("Say hello.", max_tokens=4), metadata=api_md, timeout=120)
    assert resp.usage.completion_tokens > 0 and resp.trace_id


def test_sigterm_drains_the_call_in_flight(own_mesh, api_md, gateway_request):
    """SIGTERM to the inference stage mid-generation: the streamed answer still completes."""
    mesh = own_mesh
    mesh.wait_serving(120)
    pid = mesh.state()["processes"]["inference-0.0"]["pid"]
    with grpc.insecure_channel(mesh.gateway) as ch:
        stream = mesh.stub(ch).GenerateStream(
            gateway_request("Write a long story about a lighthouse keeper.", max_tokens=48),
            metadata=api_md, timeout=300)
        first = next(stream)
        assert first.WhichOneof("event") == "delta"
        os.kill(pid, signal.SIGTERM)
        rest = list(stream)
    done = rest[-1]
    assert done.WhichOneof("event") == "done" and done.done.usage.completion_tokens >= 2
    log = mesh.tmp / "var" / "log" / "inference-0.0.log"
    wait_until(lambda: '"msg": "stopped"' in log.read_text(), 60, "the drained inference process to stop")
    assert '"msg": "draining"' in log.read_text()


def test_the_http_front_sends_a_call_again_across_a_gateway_restart(own_mesh):
    """kill -9 the gateway: the OpenAI-compatible front, still up, sends the next call again once the
    supervisor has the gateway back (nothing was generated for it: shared/client.py's Reconnect), so
    the caller gets its answer instead of an error. What it answers when the gateway stays down
    (503 CONNECTION_LOST with Retry-After) is tests/openai/test_server.py's."""
    mesh = own_mesh
    mesh.wait_serving(120)
    api = client(mesh)
    ask = dict(model=MODEL_ID, messages=ASK, max_tokens=2, temperature=0)
    assert api.chat.completions.create(**ask).choices[0].message.content
    old_pid = mesh.state()["processes"]["gateway-0.0"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    assert api.chat.completions.create(**ask).choices[0].message.content
    assert mesh.state()["processes"]["gateway-0.0"]["pid"] != old_pid  # answered by the restarted one
