"""keel-client honours the server's retry hints (a scripted in-process gateway) and sends a call
again when its connection was lost before any answer (a stand-in gateway process that dies as under
kill -9 and is restarted on its port: testing/dying_gateway.py)."""
from __future__ import annotations

import asyncio
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients/python/src"))
from keel_client import AsyncClient, Client, Reconnect, errors  # noqa: E402

from testing.dying_gateway import ANSWER, Keeper  # noqa: E402
from testing.ports import free_port  # noqa: E402

# A wait for the connection that outlasts the stand-in's restart (a Python start) on a loaded host.
PATIENT = Reconnect(ready_s=50)


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


@pytest.fixture
def dying(tmp_path):
    keeper = Keeper(free_port(), tmp_path / "calls")
    keeper.start()
    yield keeper
    keeper.stop()


def test_a_call_whose_gateway_dies_is_sent_again(dying):
    with Client(f"127.0.0.1:{dying.port}", api_key="k", timeout=60, reconnect=PATIENT) as keel:
        assert keel.generate("hi").text == ANSWER
    assert dying.calls() == 2 and dying.starts >= 2  # the lost call, then the one the restarted process answered


def test_a_stream_is_sent_again_before_its_first_event(dying):
    with Client(f"127.0.0.1:{dying.port}", api_key="k", timeout=60, reconnect=PATIENT) as keel:
        events = list(keel.stream("die-first"))
    assert events[-1].text == ANSWER and dying.calls() == 2


def test_a_stream_is_not_sent_again_after_its_first_event(dying):
    with Client(f"127.0.0.1:{dying.port}", api_key="k", timeout=60, reconnect=PATIENT) as keel:
        stream = keel.stream("die-after-first")
        with pytest.raises(errors.Unavailable) as exc:
            list(stream)
    assert exc.value.connection_lost and dying.calls() == 1  # the delta reached the caller: not replayed


def test_the_async_client_sends_a_lost_call_again(dying):
    async def ask():
        async with AsyncClient(f"127.0.0.1:{dying.port}", api_key="k", timeout=60, reconnect=PATIENT) as keel:
            answer = await keel.generate("hi")
            stream = await keel.stream("die-first")  # the marker exists now: this one is answered
            return answer, [e async for e in stream]
    answer, events = asyncio.run(ask())
    assert answer.text == ANSWER and events[-1].text == ANSWER and dying.calls() == 3


@pytest.mark.timeout(60)  # a hang, not a timing: the attempts end long before
def test_an_unreachable_gateway_is_given_up_after_the_attempts():
    reconnect = Reconnect(attempts=3, base_s=0.01, cap_s=0.02, ready_s=0.5)
    with Client(f"127.0.0.1:{free_port()}", api_key="k", timeout=30, reconnect=reconnect) as keel, \
            pytest.raises(errors.Unavailable) as exc:
        keel.generate("hi")
    assert exc.value.connection_lost and exc.value.retry_after_ms is None
