"""What a stage offers tools and orchestrators besides its own API: grpc.health.v1 (Check, Watch
and List) and server reflection (v1 and v1alpha).

grpcio-health-checking 1.85.1's servicer implements Check and Watch but answers List with
UNIMPLEMENTED; ``HealthServicer`` adds it. grpcio-reflection 1.85.1 ships only the v1alpha
service; v1 has the same messages on the wire under the package ``grpc.reflection.v1``, so the same
servicer answers both.
"""
from __future__ import annotations

from typing import Iterable

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class HealthServicer(health.aio.HealthServicer):
    """The library's servicer plus List: every service's current status."""

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        # _server_status is the base class's one record of statuses (name -> ServingStatus).
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()})


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Server reflection v1 and v1alpha over ``service_names`` (health and reflection are added)."""
    names = (*service_names, health.SERVICE_NAME, REFLECTION_V1, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))
