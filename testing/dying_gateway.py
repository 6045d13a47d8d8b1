"""A stand-in gateway process that dies as under kill -9 once, and a keeper that restarts it on
the same port (as the supervisor does): what a caller's retries of a lost connection are tested
against (tests/contract/test_client_retry.py, tests/openai/test_gateway_retry.py).

The process dies with ``os._exit`` (the kernel resets its connections, no gRPC status is sent) on
the first call that finds no ``marker`` file (it creates it first), so exactly one call in a test
is lost; every later process answers. Where it dies depends on the prompt: "die-after-first"
streams one delta first, anything else dies before any answer. A test counts the calls that
reached a process by the lines of ``marker``.

Run: python -m testing.dying_gateway PORT MARKER
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ANSWER = "ok"
ROOT = Path(__file__).resolve().parents[1]


class DyingGateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, marker: Path):
        self.marker = marker

    def _seen(self) -> bool:
        """Counts the call; True for the first call of the test (the one to die on)."""
        first = not self.marker.exists()
        with self.marker.open("a") as f:
            f.write("call\n")
        return first

    def Generate(self, request, context):
        if self._seen():
            os._exit(137)
        return gateway_pb2.GenerateResponse(text=ANSWER, trace_id="e" * 32)

    def GenerateStream(self, request, context):
        first = self._seen()
        if first and request.prompt != "die-after-first":
            os._exit(137)
        yield gateway_pb2.GenerateStreamResponse(delta=ANSWER)
        if first:
            # Let the caller read the delta first: a process that exits with unread input resets the
            # connection, and a reset can discard what the caller had not read yet.
            time.sleep(0.5)
            os._exit(137)
        yield gateway_pb2.GenerateStreamResponse(done=gateway_pb2.GenerateResponse(text=ANSWER, trace_id="e" * 32))


class Keeper(threading.Thread):
    """Runs the stand-in on ``port`` and starts it again whenever it dies, until ``stop()``."""

    def __init__(self, port: int, marker: Path):
        super().__init__(daemon=True)
        self.port, self.marker = port, marker
        self.starts = 0
        self._stopping = threading.Event()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "testing.dying_gateway", str(self.port), str(self.marker)],
                                      cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        self.starts += 1

    def run(self) -> None:
        while not self._stopping.is_set():
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._stopping.wait(0.05)

    def stop(self) -> None:
        self._stopping.set()
        self.join()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def calls(self) -> int:
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0


def main() -> None:
    port, marker = int(sys.argv[1]), Path(sys.argv[2])
    server = grpc.server(futures.ThreadPoolExecutor(4))
    gateway_pb2_grpc.add_GatewayServicer_to_server(DyingGateway(marker), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
