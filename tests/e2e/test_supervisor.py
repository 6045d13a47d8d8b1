"""Kills under `keel up`, on one mesh of one process per stage (killing the process kills the stage),
its own so that the other end-to-end tests see an undisturbed one. In this order, since each leaves
the mesh as the next expects it:

1. a short chaos run (bench/chaos.py is the long one) on the fresh mesh: requests from concurrent
   keel-client clients while the gateway, tokenizer and validator processes are killed -9 (stages
   that restart in seconds; the inference stage's restart, a model load, is what the benchmark
   measures and tests/gateway/test_replica_loss.py checks with a real process). Every request ends
   OK or with a clear status (a code other than INTERNAL/UNKNOWN, an ErrorInfo reason; a retry hint
   unless its own deadline ran out), none hangs, and most succeed: a request caught by a kill of a
   stage behind the gateway is re-dispatched or held for the restarted replica, one lost with the
   gateway is sent again by keel-client;
2. kill -9 each stage: it comes back SERVING, the restart is logged, the next request is answered;
   SIGTERM drains the call in flight; the HTTP front rides over a gateway restart;
3. kill -9 of the supervisor: every stage and Redis die with it (parent-death signal), nothing keeps
   listening, and `keel status` does not report the dead mesh as healthy."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest

from bench.chaos import ChaosConfig, run_phase, summary
from keelctl import health, procs
from keelctl.layout import load_layout
from keelctl.supervisor import layout_ports
from shared.modelfile import model_id
from testing.mesh import ROOT, start_mesh, stop_mesh, wait_until
from tests.e2e.conftest import SERVICES
from tests.e2e.test_openai import ASK, client

MODEL_ID = model_id()  # the served model's name (shared/modelfile.py)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def own_mesh(tmp_path_factory):
    m = start_mesh(tmp_path_factory.mktemp("kill9"), tokenizer_workers=1)  # killing the one process kills the stage
    yield m
    stop_mesh(m)


@pytest.mark.timeout(600)  # a held request may wait out a slow restart on a loaded machine
def test_requests_survive_stage_kills(own_mesh):
    # seed 3 picks the gateway, the tokenizer, then the validator
    cfg = ChaosConfig(requests=48, clients=8, kill_every_s=1.0, max_tokens=4, deadline_s=120.0, replicas=1,
                      max_kills=3, stages=("gateway", "tokenizer", "validator"), seed=3)
    outcomes, killer, _ = run_phase(own_mesh, cfg, chaos=True)
    result = summary(outcomes)
    # kills land while requests are in flight (how many fit depends on how fast the requests go)
    assert 1 <= len(killer.kills) <= 3, (killer.kills, killer.skips)
    assert killer.kills[0]["process"] == "gateway-0.0", killer.kills  # its first turn: the gateway is SERVING
    assert result["hung"] == 0 and result["unclear"] == 0 and result["unhinted"] == 0, result["by_status"]
    assert result["ok"] > cfg.requests // 2, result["by_status"]


@pytest.mark.parametrize("stage", ["tokenizer", "inference", "validator", "gateway", "redis"])
def test_kill9_stage_is_restarted_and_serves_again(own_mesh, stage, api_md, gateway_request):
    mesh = own_mesh
    mesh.wait_serving(120)  # every stage the test before killed is back
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
    """SIGTERM to the inference stage mid-generation: the streamed answer still completes. 16 tokens:
    the answer must end within the stage's drain_grace_s (30 s) even on a loaded 2-core host."""
    mesh = own_mesh
    mesh.wait_serving(120)
    pid = mesh.state()["processes"]["inference-0.0"]["pid"]
    with grpc.insecure_channel(mesh.gateway) as ch:
        stream = mesh.stub(ch).GenerateStream(
            gateway_request("Write a long story about a lighthouse keeper.", max_tokens=16),
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


def test_children_die_with_a_killed_supervisor(own_mesh):
    """Last: it ends the mesh (the fixture's stop then finds the supervisor gone)."""
    mesh = own_mesh
    mesh.wait_serving(120)
    pids = [p["pid"] for p in mesh.state()["processes"].values()]
    # Redis and one process per stage (validator, tokenizer, inference, feedback, gateway, openai)
    assert len(pids) == 7 and all(procs.alive(p) for p in pids)
    os.kill(mesh.proc.pid, signal.SIGKILL)
    mesh.proc.wait()
    wait_until(lambda: not any(procs.alive(p) for p in pids), 60, "every child of the killed supervisor to exit")
    env = dict(os.environ, KEEL_KEEL_CONFIG=str(mesh.tmp / "keel.json"), KEEL_VAR_DIR=str(mesh.tmp / "var"))
    # A process whose main thread has exited shows as a zombie while its other threads (torch's,
    # grpc's) still tear down its memory; its sockets close when the last one is gone.
    ports = layout_ports(load_layout(mesh.tmp / "keel.json"))
    wait_until(lambda: not procs.held_ports(ports), 60, "every port of the dead mesh to be released")
    out = subprocess.run([sys.executable, "-m", "keelctl", "status"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "keel is not running" in out.stdout, out.stdout
