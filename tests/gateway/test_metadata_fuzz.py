"""Property: whatever metadata and deadline a gRPC client sends, the gateway answers with a status
whose details carry a google.rpc.ErrorInfo reason, or OK (issue 44). The gateway's interceptor and
its own authentication (keys and limits from config/gateway.yaml) run for real; behind them the
gateway's servicer answers ListModels from a stand-in pipeline, so the servicer's own reading of the
call (deadline, trace, metadata) runs too. Bounded: a fixed number of examples, one call each."""
from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keel.gateway.v1 import gateway_pb2
from shared import proxyauth
from tests.gateway.served import served_gateway
from tests.gateway.test_auth_failures import shipped_config, stage_with

NAMES = ("authorization", "x-api-key", "traceparent", "tracestate", proxyauth.CLIENT_HEADER, proxyauth.HEADER,
         "x-keel-previous-attempts", "grpc-previous-rpc-attempts", "x-keel-deadline-ms", "x-keel-mesh-token")
PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64)
values = st.one_of(PRINTABLE, st.integers(min_value=1, max_value=400).map(lambda n: "9" * n),
                   st.sampled_from(["keel-dev-key", "Bearer keel-dev-key", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"]),
                   st.integers(min_value=1, max_value=6).map(lambda k: "k" * (k * 1000)))
metadata = st.lists(st.tuples(st.one_of(st.sampled_from(NAMES), st.from_regex(r"x-[a-z0-9-]{1,10}", fullmatch=True)),
                              values), max_size=5)
binary = st.lists(st.tuples(st.from_regex(r"x-[a-z0-9]{1,8}-bin", fullmatch=True), st.binary(max_size=64)), max_size=2)
timeouts = st.one_of(st.none(), st.floats(min_value=0.2, max_value=1e9), st.sampled_from([1e6, 3.0e7, 1e9]))


class Pipeline:
    """The stand-in: ListModels' adapters, at once."""

    async def adapters(self, call):
        return ["a@1"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A stub of the gateway (its real interceptor and the shipped keys) over the stand-in pipeline."""
    stage = stage_with(tmp_path_factory.mktemp("gw"), shipped_config())
    with served_gateway(stage, Pipeline, stage.cfg.limits) as stub:
        yield stub


def answered_by_grpc(exc: grpc.RpcError) -> bool:
    """Metadata over gRPC's own size limit is refused by gRPC before any Keel code runs."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size exceeds" in (exc.details() or "")


def reason_of(exc: grpc.RpcError) -> str | None:
    status = rpc_status.from_call(exc)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(md=metadata, extra=binary, timeout=timeouts)
def test_every_refusal_has_an_errorinfo_reason(gateway, md, extra, timeout):
    try:
        gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=(*md, *extra), timeout=timeout)
    except grpc.RpcError as exc:
        assert exc.code() != grpc.StatusCode.INTERNAL, exc.details()
        assert answered_by_grpc(exc) or reason_of(exc), (exc.code(), exc.details())
