"""The gateway's servicer behind the real interceptor (the stage's authentication), served on an event
loop of its own thread, for synchronous gRPC tests of what reaches the wire."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc

from keel.gateway.v1 import gateway_pb2_grpc
from services.gateway.servicer import GatewayServicer
from shared.interceptor import ServerInterceptor


@contextlib.contextmanager
def served_gateway(stage, make_pipeline, limits) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """A stub of GatewayServicer(make_pipeline(), limits) authenticated by `stage`; the pipeline is
    made on the serving loop."""
    loop = asyncio.new_event_loop()
    ready, holder = threading.Event(), {}

    async def serve():
        srv = grpc.aio.server(interceptors=[ServerInterceptor("gateway", authenticate=stage.authenticate)])
        gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(make_pipeline(), limits, None), srv)
        holder["port"] = srv.add_insecure_port("127.0.0.1:0")
        holder["stop"] = asyncio.Event()
        await srv.start()
        ready.set()
        await holder["stop"].wait()
        await srv.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{holder['port']}") as ch:
            yield gateway_pb2_grpc.GatewayStub(ch)
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)
