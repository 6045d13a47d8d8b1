"""keel-client honours the server's retry hints (unit test: a scripted in-process gateway)."""
from __future__ import annotations

import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients/python/src"))
from keel_client import Client, errors  # noqa: E402


def _status(code: grpc.StatusCode, reason: str, retry_ms: int | None) -> tuple:
    details = [error_details_pb2.ErrorInfo(reason=reason, domain="keel.dev")]
    if retry_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(retry_ms)
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    status = status_pb2.Status(code=code.value[0], message=reason, details=packed)
    return (("grpc-status-details-bin", status.SerializeToString()), ("x-keel-trace-id", "f" * 32))


class Scripted(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, failures):
        self.failures, self.calls = list(failures), 0

    def Generate(self, request, context):
        self.calls += 1
        if self.failures:
            code, reason, retry_ms = self.failures.pop(0)
            context.abort_with_status(_RichStatus(code, reason, _status(code, reason, retry_ms)))
        return gateway_pb2.GenerateResponse(text="ok", trace_id="e" * 32)


class _RichStatus(grpc.Status):
    def __init__(self, code, details, trailing_metadata):
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


@pytest.fixture
def serve():
    servers = []

    def start(failures):
        servicer = Scripted(failures)
        srv = grpc.server(futures.ThreadPoolExecutor(2))
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return servicer, f"127.0.0.1:{port}"
    yield start
    for srv in servers:
        srv.stop(None)


def test_a_hinted_overload_is_retried(serve):
    servicer, target = serve([(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", 20)])
    with Client(target, api_key="k", timeout=10) as keel:
        assert keel.generate("hi").text == "ok"
    assert servicer.calls == 2


def test_no_hint_no_retry_and_the_reason_class_is_raised(serve):
    servicer, target = serve([(grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", None)])
    with Client(target, api_key="k", timeout=10) as keel, pytest.raises(errors.RateLimited) as exc:
        keel.generate("hi")
    assert servicer.calls == 1 and exc.value.trace_id == "f" * 32 and exc.value.retry_after_ms is None


def test_retries_stop_after_max_retries(serve):
    servicer, target = serve([(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING", 10)] * 5)
    with Client(target, api_key="k", timeout=10, max_retries=2) as keel, pytest.raises(errors.Unavailable) as exc:
        keel.generate("hi")
    assert servicer.calls == 3 and exc.value.retry_after_ms == 10


def test_a_hint_beyond_the_deadline_is_not_waited_for(serve):
    servicer, target = serve([(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING", 60_000)])
    with Client(target, api_key="k", timeout=5) as keel, pytest.raises(errors.Unavailable):
        keel.generate("hi")
    assert servicer.calls == 1
