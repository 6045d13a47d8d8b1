"""A stand-in tokenizer replica for the gateway's transport tests, as its own process so a test can
kill -9 it: ``python -m tests.gateway.tokenizer_stub PORT {hang|pid|fail}``.

hang: Encode never answers (a call in flight when the process dies); slow: Encode answers after
1 s; pid: Encode answers with this
process's pid as its only id; fail: Encode answers UNAVAILABLE through the Keel interceptor (a live
but failing upstream). Health says SERVING in every mode.
"""
from __future__ import annotations

import asyncio
import os
import sys

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keel.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from shared import errors
from shared.interceptor import ServerInterceptor

SERVICE = "keel.tokenizer.v1.Tokenizer"


class Tokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, mode: str):
        self.mode = mode
        self.calls = 0

    async def Encode(self, request, context):
        self.calls += 1
        if self.mode in ("hang", "slow"):
            await asyncio.sleep(3600 if self.mode == "hang" else 1.0)
        if self.mode == "fail":
            raise errors.NotReady("this replica is failing", reason="TEST_FAILING")
        return tokenizer_pb2.EncodeResponse(input_ids=[os.getpid()])


async def serve(port: int, mode: str, *, reuse_port: bool = False) -> tuple[grpc.aio.Server, Tokenizer]:
    server = grpc.aio.server(interceptors=[ServerInterceptor("tokenizer")],
                             options=[("grpc.so_reuseport", int(reuse_port))])
    servicer = Tokenizer(mode)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return server, servicer


async def main(port: int, mode: str) -> None:
    server, _ = await serve(port, mode)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
