"""The HTTP stage's process (``python -m services.openai``) in front of a stand-in gateway that checks
keys as the real one does (only KEY passes: INVALID_API_KEY / MISSING_API_KEY otherwise) and answers
at once, for the edge tests: what reaches the gateway, and what the stage refuses alone."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from openai import OpenAI

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl import health
from shared import errors, proxyauth
from shared.interceptor import to_status
from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
KEY = "k-good-0123456789"
PROXY = "proxy-token-for-the-edge-tests"


class Gateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple[str, dict]] = []  # (method, metadata)

    def _admit(self, method: str, context) -> None:
        md = dict(context.invocation_metadata())
        with self.lock:
            self.calls.append((method, md))
        presented = md.get("x-api-key") or md.get("authorization", "").removeprefix("Bearer ")
        if presented != KEY:
            err = errors.Unauthenticated("API key not recognised" if presented else "no API key",
                                         reason="INVALID_API_KEY" if presented else "MISSING_API_KEY")
            code, message, trailers = to_status(err)
            context.set_trailing_metadata(trailers)
            context.abort(code, message)

    def Generate(self, request, context):
        self._admit("Generate", context)
        return gateway_pb2.GenerateResponse(text="ok", trace_id="ab" * 16, finish_reason="stop")

    def GenerateStream(self, request, context):
        self._admit("GenerateStream", context)
        yield gateway_pb2.GenerateStreamResponse(delta="ok")
        yield gateway_pb2.GenerateStreamResponse(done=gateway_pb2.GenerateResponse(finish_reason="stop"))

    def ListModels(self, request, context):
        self._admit("ListModels", context)
        return gateway_pb2.ListModelsResponse()

    def seen(self, method: str) -> list[dict]:
        with self.lock:
            return [md for m, md in self.calls if m == method]


@contextlib.contextmanager
def running(log_path: Path | None, gateway: gateway_pb2_grpc.GatewayServicer | None = None, **settings: str):
    """(base URL, stand-in gateway) of a stage in front of ``gateway`` (this module's Gateway if
    None) whose config is overridden by ``settings`` (KEEL_OPENAI_<NAME> -> value); the stage's log
    goes to ``log_path`` (None: nowhere)."""
    gateway = gateway or Gateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_pb2_grpc.add_GatewayServicer_to_server(gateway, server)
    gport = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port = free_port()
    env = dict(os.environ, KEEL_OPENAI_SERVER__PORT=str(port), KEEL_OPENAI_GATEWAY=f"[127.0.0.1:{gport}]",
               **{proxyauth.ENV: PROXY}, **{f"KEEL_OPENAI_{k.upper()}": v for k, v in settings.items()})
    env.pop("KEEL_MESH_TLS_DIR", None)
    with open(log_path or os.devnull, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.openai"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        health.wait_serving({"openai": (f"127.0.0.1:{port}", health.HTTP)}, 60, lambda: proc.poll() is None)
        yield f"http://127.0.0.1:{port}", gateway
    finally:
        proc.kill()
        proc.wait()
        server.stop(None)


def client(url: str) -> OpenAI:
    """The openai SDK on a stage ``running`` serves (its retries off: the status under test shows)."""
    return OpenAI(base_url=f"{url}/v1", api_key="k-123", max_retries=0, timeout=30)
