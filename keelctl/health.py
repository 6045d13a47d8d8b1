"""Health checks for the CLI and tests: grpc.health.v1 for the gRPC stages (sync grpc: the CLI has
no event loop), ``GET /health`` for the HTTP ones (shared.stages.HTTP_STAGES)."""
from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import tls
from shared.stages import HTTP_STAGES, SERVICE_NAMES

# The "service" to check on an HTTP stage: its GET /health (HTTPS when the mesh serves TLS).
HTTP = "GET /health"


def service_of(stage: str) -> str:
    return HTTP if stage in HTTP_STAGES else SERVICE_NAMES[stage]


def http_status(target: str, timeout_s: float = 1.0) -> str:
    """The status an HTTP stage's GET /health reports (SERVING, NOT_SERVING), or DOWN."""
    folder = tls.mesh_dir()
    ctx = ssl.create_default_context(cafile=str(folder / "ca.pem")) if folder else None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(f"{'https' if folder else 'http'}://{target}/health", timeout=timeout_s) as resp:
            return str(json.load(resp).get("status", "UNKNOWN"))
    except urllib.error.HTTPError as exc:
        return "NOT_SERVING" if exc.code == 503 else "UNKNOWN"
    except (OSError, ValueError):
        return "DOWN"


def status(target: str, service: str = "", timeout_s: float = 1.0) -> str:
    """SERVING, NOT_SERVING, UNKNOWN or DOWN (no answer)."""
    if service == HTTP:
        return http_status(target, timeout_s)
    try:
        with tls.sync_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "DOWN"


def wait_serving(targets: dict[str, tuple[str, str]], timeout_s: float,
                 still_alive=lambda: True, watch=None) -> dict[str, str]:
    """Poll every (target, service) until all are SERVING; returns the last status of each.
    `watch`, when given, gets each poll's statuses (keelctl/startview.py shows them)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    while True:
        last = {name: status(t, s) for name, (t, s) in targets.items()}
        if watch is not None:
            watch(last)
        if all(v == "SERVING" for v in last.values()):
            return last
        if time.monotonic() > deadline or not still_alive():
            raise TimeoutError(f"not SERVING within {timeout_s:.0f}s: " +
                               ", ".join(f"{k}={v}" for k, v in last.items() if v != "SERVING"))
        time.sleep(0.2)
