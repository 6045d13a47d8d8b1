"""The client contract against the real mesh: a caller's trace joined, the trace id in the initial
metadata, Health/List, and server reflection v1 on the gateway only."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from shared.discovery import REFLECTION_V1
from shared.interceptor import TRACE_ID_KEY
from testing.mesh import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def _reflect(channel, method: str, request: reflection_pb2.ServerReflectionRequest):
    call = channel.stream_stream(f"/{method}/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return next(iter(call(iter([request]), timeout=10)))


def test_a_callers_trace_is_joined_and_its_id_comes_in_the_initial_metadata(mesh, api_md, gateway_request):
    md = api_md + (("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"), ("tracestate", "vendor=abc"))
    with grpc.insecure_channel(mesh.gateway) as ch:
        call = mesh.stub(ch).GenerateStream(gateway_request("Say hi.", max_tokens=4), metadata=md, timeout=120)
        initial = dict(call.initial_metadata())
        items = list(call)
        trailers = dict(call.trailing_metadata())
    assert initial[TRACE_ID_KEY] == CALLER_TRACE == trailers[TRACE_ID_KEY] == items[-1].done.trace_id
    # The gateway's root span ends after the stream does, so it can reach the exporter last.
    spans = wait_until(lambda: (s := mesh.spans(CALLER_TRACE)) and {"tokenizer", "inference", "validator"}
                       <= {x["service"] for x in s} and _root(s) and s, 30, "spans of every stage in the caller's "
                                                                            "trace")
    assert _root(spans)["parent_id"] == CALLER_SPAN


def _root(spans: list[dict]) -> dict | None:
    return next((s for s in spans if s["service"] == "gateway" and s["name"] == "gateway/GenerateStream"), None)


def test_an_invalid_traceparent_starts_a_new_trace_and_is_logged(mesh, api_md, gateway_request):
    md = api_md + (("traceparent", "00-not-a-trace-01"),)
    with grpc.insecure_channel(mesh.gateway) as ch:
        resp, call = mesh.stub(ch).Generate.with_call(gateway_request("Say hi.", max_tokens=2), metadata=md,
                                                      timeout=120)
    assert len(resp.trace_id) == 32 and dict(call.initial_metadata())[TRACE_ID_KEY] == resp.trace_id
    wait_until(lambda: any(r.get("msg", "").startswith("ignoring an invalid traceparent")
                           for r in mesh.log("gateway-0.0")),
               10, "the gateway's log record of the invalid traceparent")


def test_health_list_answers_every_service(mesh):
    with grpc.insecure_channel(mesh.gateway) as ch:
        listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=10)
    assert {name: st.status for name, st in listed.statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, "keel.gateway.v1.Gateway": health_pb2.HealthCheckResponse.SERVING}


@pytest.mark.parametrize("service", [REFLECTION_V1, "grpc.reflection.v1alpha.ServerReflection"])
def test_the_gateway_offers_reflection_v1_and_v1alpha(mesh, service):
    with grpc.insecure_channel(mesh.gateway) as ch:
        listed = _reflect(ch, service, reflection_pb2.ServerReflectionRequest(list_services=""))
        found = _reflect(ch, service, reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="keel.gateway.v1.GenerateRequest"))
    names = {s.name for s in listed.list_services_response.service}
    assert {"keel.gateway.v1.Gateway", "grpc.health.v1.Health", REFLECTION_V1} <= names
    assert found.file_descriptor_response.file_descriptor_proto


def test_internal_stages_offer_no_reflection(mesh):
    with grpc.insecure_channel(f"127.0.0.1:{mesh.ports['tokenizer'][0]}") as ch:
        with pytest.raises(grpc.RpcError) as exc:
            _reflect(ch, REFLECTION_V1, reflection_pb2.ServerReflectionRequest(list_services=""))
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
