"""A stage for the shared server bootstrap's tests: tokenizer-shaped, its Encode never finishes
(or, mode "slow", finishes after 1 s)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keel.tokenizer.v1 import tokenizer_pb2_grpc
from tests.gateway.tokenizer_stub import Tokenizer

SERVICE = "keel.tokenizer.v1.Tokenizer"


class HangingStage:
    name = "tokenizer"
    service_name = SERVICE

    def __init__(self, mode: str = "hang"):
        self.servicer = Tokenizer(mode)

    def register(self, server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self.servicer, server)

    async def warmup(self) -> None:
        return None

    async def close(self) -> None:
        return None


async def serving(port: int) -> None:
    """Returns once the stage on ``port`` reports SERVING."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), wait_for_ready=True):
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
