"""keel-client's adapter parameter and its typed refusals (unit test: a scripted in-process gateway)."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.contract.test_client_retry import Client, Scripted, _RichStatus, _status, errors

REFUSED = {"drifted": "base_fingerprint differs: weights"}


class AdapterGateway(Scripted):
    """Answers with the adapter's newest version, NOT_FOUND for an unknown one, FAILED_PRECONDITION
    for a refused one."""

    def __init__(self):
        super().__init__([])
        self.adapters: list[str] = []

    def Generate(self, request, context):
        self.calls += 1
        self.adapters.append(request.adapter)
        if request.adapter in REFUSED:
            code, reason = grpc.StatusCode.FAILED_PRECONDITION, "ADAPTER_REFUSED"
        elif request.adapter not in ("", "pirate"):
            code, reason = grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND"
        else:
            return gateway_pb2.GenerateResponse(text="arr", trace_id="e" * 32,
                                                adapter="pirate@2" if request.adapter else "")
        context.abort_with_status(_RichStatus(code, reason, _status(code, reason, None)))


@pytest.fixture
def gateway():
    servicer = AdapterGateway()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(None)


def test_adapter_is_sent_and_the_serving_version_returned(gateway):
    servicer, target = gateway
    with Client(target, api_key="k", timeout=10) as keel:
        assert keel.generate("hi", adapter="pirate").adapter == "pirate@2"
        assert keel.generate("hi").adapter == ""
    assert servicer.adapters == ["pirate", ""]


@pytest.mark.parametrize("name, cls, parent", [("ghost", errors.AdapterNotFound, errors.NotFound),
                                                ("drifted", errors.AdapterRefused, errors.FailedPrecondition)])
def test_adapter_refusals_are_typed_and_never_retried(gateway, name, cls, parent):
    servicer, target = gateway
    with Client(target, api_key="k", timeout=10) as keel, pytest.raises(cls) as exc:
        keel.generate("hi", adapter=name)
    assert isinstance(exc.value, parent) and not exc.value.retryable
    assert servicer.calls == 1
