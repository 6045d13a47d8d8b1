"""The adapter over gRPC between the gateway and a stand-in inference replica (in-process, behind the
Keel server interceptor): sent in GenerateRequest.adapter, Finished.adapter read back into Done, and
the engine's refusals translated with their status, reason and metadata, the replica still healthy."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from services.gateway.upstreams import MeshUpstreams
from services.gateway.values import Done, Encoded, Step
from shared import errors
from shared.interceptor import ServerInterceptor
from shared.stages import SERVICE_NAMES
from testing.ports import free_port
from tests.gateway.test_pipeline import ask


class Inference(inference_pb2_grpc.InferenceServicer):
    """Knows one adapter, pirate (version 3); refuses "drifted" as a start-up refusal would."""

    def __init__(self):
        self.adapters: list[str] = []

    async def Generate(self, request, context):
        self.adapters.append(request.adapter)
        if request.adapter == "drifted":
            raise errors.PreconditionFailed("adapter drifted@1 was refused at start", reason="ADAPTER_REFUSED",
                                            metadata={"adapter": "drifted@1", "refusal_reason": "ADAPTER_DRIFT"})
        if request.adapter not in ("", "pirate"):
            raise errors.NotFound(f"no adapter {request.adapter!r}", reason="ADAPTER_NOT_FOUND",
                                  metadata={"adapter": request.adapter})
        yield inference_pb2.GenerateEvent(token=inference_pb2.Token(id=7, entropy=0.5))
        yield inference_pb2.GenerateEvent(finished=inference_pb2.Finished(
            finish_reason="stop", seed=1, adapter="pirate@3" if request.adapter else ""))


    async def ListAdapters(self, request, context):
        return inference_pb2.ListAdaptersResponse(adapters=[
            inference_pb2.AdapterState(id="pirate", version="3", state="accepted", slot=1),
            inference_pb2.AdapterState(id="drifted", version="1", state="refused", reason="ADAPTER_DRIFT"),
            inference_pb2.AdapterState(id="french", version="2", state="accepted", slot=2)])


@pytest_asyncio.fixture
async def replica():
    port = free_port()
    server = grpc.aio.server(interceptors=[ServerInterceptor("inference")])
    servicer = Inference()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set(SERVICE_NAMES["inference"], health_pb2.HealthCheckResponse.SERVING)
    # Only inference is called; the other stages' ports have no server.
    up = MeshUpstreams({"inference": (f"127.0.0.1:{port}",), "tokenizer": (f"127.0.0.1:{free_port()}",),
                        "validator": (f"127.0.0.1:{free_port()}",)}, 1 << 22, 1)
    up.start()
    yield servicer, up
    await up.close()
    await server.stop(None)


async def events(up, adapter: str):
    return [ev async for ev in up.generate(Encoded([1, 2], False, 2, "fp"), ask(adapter=adapter), 1, 30, {})]


@pytest.mark.asyncio
async def test_adapter_is_sent_and_the_served_one_read_back(replica):
    servicer, up = replica
    out = await events(up, "pirate")
    assert isinstance(out[0], Step) and isinstance(out[-1], Done) and out[-1].adapter == "pirate@3"
    assert (await events(up, ""))[-1].adapter == ""
    assert servicer.adapters == ["pirate", ""]


@pytest.mark.parametrize("name, cls, reason, metadata", [
    ("ghost", errors.NotFound, "ADAPTER_NOT_FOUND", {"adapter": "ghost"}),
    ("drifted", errors.PreconditionFailed, "ADAPTER_REFUSED",
     {"adapter": "drifted@1", "refusal_reason": "ADAPTER_DRIFT"}),
])
@pytest.mark.asyncio
async def test_engine_refusals_arrive_as_sent_and_the_replica_stays_up(replica, name, cls, reason, metadata):
    servicer, up = replica
    with pytest.raises(cls) as exc:
        await events(up, name)
    assert exc.value.code == cls.code and exc.value.reason == reason
    assert {k: exc.value.metadata[k] for k in metadata} == metadata
    assert (await events(up, "pirate"))[-1].adapter == "pirate@3"  # not marked down: a refusal is not an outage


@pytest.mark.asyncio
async def test_list_adapters_names_the_accepted_ones_sorted(replica):
    _servicer, up = replica
    assert await up.list_adapters(30, {}) == ["french@2", "pirate@3"]
