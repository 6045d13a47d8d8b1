"""The whole mesh as real processes: `python -m keelctl up` (Redis and every stage, the real model)
on free loopback ports, with its var/ and traces/ in a temporary folder. Used by the e2e tests and
by the benches that measure with the whole mesh running."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from keel.gateway.v1 import gateway_pb2_grpc
from keelctl import health
from keelctl.supervisor import worker_metrics_port
from keelctl.trace import load_spans
from shared.config import ROOT_DIR as ROOT
from testing.ports import free_port


class Mesh:
    def __init__(self, tmp: Path, ports: dict[str, list[int]], redis_port: int, proc: subprocess.Popen):
        self.tmp, self.ports, self.redis_port, self.proc = tmp, ports, redis_port, proc
        self.gateway = f"127.0.0.1:{ports['gateway'][0]}"
        # every gateway replica, as one grpc target (a channel uses them round robin)
        self.gateways = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports["gateway"])
        self.http = f"127.0.0.1:{ports['openai'][0]}"  # the OpenAI-compatible API

    def state(self) -> dict:
        return json.loads((self.tmp / "var" / "run" / "keel.json").read_text())

    def targets(self) -> dict[str, tuple[str, str]]:
        return {f"{s}@{p}": (f"127.0.0.1:{p}", health.service_of(s)) for s, ps in self.ports.items() for p in ps}

    def wait_serving(self, timeout_s: float = 240) -> None:
        health.wait_serving(self.targets(), timeout_s, lambda: self.proc.poll() is None)

    def stub(self, channel) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(channel)

    def log(self, process: str) -> list[dict]:
        """The JSON records of one process's log, e.g. "supervisor" or "gateway-0.0"."""
        lines = (self.tmp / "var" / "log" / f"{process}.log").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{") and whole_record(line)]

    def spans(self, trace_id: str) -> list[dict]:
        return load_spans(trace_id, self.tmp / "traces")


def whole_record(line: str) -> bool:
    """False for a record a kill -9 cut short (the restarted process appends after it)."""
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _metrics_port(workers: int) -> int:
    """A replica's metrics port, with the ports its other workers export on free as well."""
    return free_port(lambda port: [worker_metrics_port(port, w) for w in range(1, workers)])


def mesh_env(tmp: Path, *, tokenizer_replicas: int = 1, inference_replicas: int = 1, tokenizer_workers: int = 2,
             validator_replicas: int = 1, gateway_replicas: int = 1,
             extra_env: dict | None = None) -> tuple[dict, dict[str, list[int]], int, dict]:
    """A mesh layout on free loopback ports under ``tmp``: (layout, ports, redis port, environment)."""
    ports = {"validator": [free_port() for _ in range(validator_replicas)],
             "tokenizer": [free_port() for _ in range(tokenizer_replicas)],
             "inference": [free_port() for _ in range(inference_replicas)], "feedback": [free_port()],
             "gateway": [free_port() for _ in range(gateway_replicas)], "openai": [free_port()]}
    redis_port = free_port()
    workers = {s: tokenizer_workers if s == "tokenizer" else 1 for s in ports}
    layout = {"redis": {"port": redis_port, "dir": str(tmp / "redis")},
              # two tokenizer workers share each tokenizer port and its mmapped vocabulary
              "stages": {s: {"ports": p, "metrics_ports": [_metrics_port(workers[s]) for _ in p],
                             "workers": workers[s]} for s, p in ports.items()},
              "restart": {"initial_backoff_s": 0.2, "max_backoff_s": 5, "stable_after_s": 30},
              "ready_timeout_s": 300, "metrics_port": free_port()}
    layout["stages"]["feedback"]["webhook_ports"] = [free_port()]  # the rotation webhook
    (tmp / "keel.json").write_text(json.dumps(layout))  # JSON is YAML
    env = dict(os.environ, KEEL_KEEL_CONFIG=str(tmp / "keel.json"), KEEL_VAR_DIR=str(tmp / "var"),
               KEEL_TRACES_DIR=str(tmp / "traces"), KEEL_VALIDATOR_QUARANTINE__SPILL_PATH=str(tmp / "spill.jsonl"),
               # every mesh has a fresh var/: gating the auto candidates in the background would take
               # each one's cores for ~100 s, so the meshes serve what auto picks without stored
               # results (float32); tests/inference/test_gate_at_start.py tests the gate
               KEEL_INFERENCE_FORMATS__GATE_AT_START="false")
    env.update(extra_env or {})
    env.pop("KEEL_MESH_TOKEN", None)
    return layout, ports, redis_port, env


def start_mesh(tmp: Path, **kwargs) -> Mesh:
    """`python -m keelctl up` in the foreground (a child of the test), waited on until SERVING."""
    layout, ports, redis_port, env = mesh_env(tmp, **kwargs)
    out = open(tmp / "keel-up.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "keelctl", "up"], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    mesh = Mesh(tmp, ports, redis_port, proc)
    mesh.layout = layout
    try:
        mesh.wait_serving()  # returns at once when `keel up` exits (a stage's invalid configuration)
    except TimeoutError:
        stop_mesh(mesh)
        out = (tmp / "keel-up.out").read_text()
        failed = [line for line in out.splitlines() if line.startswith("keel up failed: ")]
        raise AssertionError("mesh did not come up" + (f": {failed[-1]}" if failed else "") + "\n" + out[-4000:])
    return mesh


def stop_mesh(mesh: Mesh) -> None:
    if mesh.proc.poll() is None:
        mesh.proc.send_signal(signal.SIGTERM)
        try:
            mesh.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(mesh.proc.pid, signal.SIGKILL)
            mesh.proc.wait()


def wait_until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
