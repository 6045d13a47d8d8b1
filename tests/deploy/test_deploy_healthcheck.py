"""deploy/docker/healthcheck.py against a real grpc.health.v1 server on loopback."""
from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "docker" / "healthcheck.py"
SERVICE = "keel.tokenizer.v1.Tokenizer"

_spec = importlib.util.spec_from_file_location("keel_healthcheck", SCRIPT)
healthcheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(healthcheck)


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_exits_zero(health_server):
    servicer, port = health_server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main(["--port", str(port), "--service", SERVICE]) == 0


def test_not_serving_exits_one(health_server):
    servicer, port = health_server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check(f"127.0.0.1:{port}", SERVICE, 2.0) == (1, "NOT_SERVING")


def test_overall_and_named_status_are_checked_separately(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["--port", str(port)]) == 0
    assert healthcheck.main(["--port", str(port), "--service", SERVICE]) == 1


def test_unknown_service_name_is_not_healthy(health_server):
    _servicer, port = health_server
    assert healthcheck.check(f"127.0.0.1:{port}", "keel.nope.v1.Nope", 2.0) == (1, "SERVICE_UNKNOWN")


def test_draining_server_is_not_healthy(health_server):
    servicer, port = health_server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    servicer.enter_graceful_shutdown()
    assert healthcheck.main(["--port", str(port), "--service", SERVICE]) == 1


def test_nothing_listening_exits_two():
    assert healthcheck.check(f"127.0.0.1:{free_port()}", SERVICE, 0.5)[0] == 2


def test_command_line_exit_status(health_server):
    servicer, port = health_server
    servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    ok = subprocess.run([sys.executable, str(SCRIPT), "--port", str(port), "--service", SERVICE],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--service", SERVICE], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--port" in bad.stderr  # argparse: the port is required


def test_an_http_stage_is_checked_by_its_health_path():
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self):
            self.send_response(Health.status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = str(server.server_address[1])
    try:
        assert healthcheck.main(["--port", port, "--http", "/health"]) == 0
        Health.status = 503
        assert healthcheck.main(["--port", port, "--http", "/health"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main(["--port", port, "--http", "/health", "--timeout", "1"]) == 2
