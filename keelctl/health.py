"""grpc.health.v1 checks for the CLI and tests (sync grpc: the CLI has no event loop)."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import tls


def status(target: str, service: str = "", timeout_s: float = 1.0) -> str:
    """SERVING, NOT_SERVING, UNKNOWN or DOWN (no answer)."""
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
