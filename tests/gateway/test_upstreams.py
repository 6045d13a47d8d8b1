"""The gateway's replica pool against real in-process servers: pick only SERVING replicas, wait
(bounded) for one to come back, give up with NO_HEALTHY_UPSTREAM, spread calls over every worker
process sharing a port; the gateway is ready with its upstreams down."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keel.tokenizer.v1 import tokenizer_pb2
from services.gateway import config as gateway_config
from services.gateway.pool import Pool
from services.gateway.server import GatewayStage
from shared import errors
from shared.stages import GATEWAY_UPSTREAMS
from shared.stages import SERVICE_NAMES as SERVICES
from testing.ports import free_port
from tests.gateway.tokenizer_stub import serve


async def health_server(port: int, status=health_pb2.HealthCheckResponse.SERVING) -> tuple[grpc.aio.Server, object]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set(SERVICES["tokenizer"], status)
    return server, servicer


@pytest.mark.asyncio
async def test_picks_only_the_serving_replica():
    up_port, down_port = free_port(), free_port()
    server, _ = await health_server(up_port)
    pool = Pool("tokenizer", (f"127.0.0.1:{up_port}", f"127.0.0.1:{down_port}"), 1 << 20)
    pool.start()
    try:
        await pool.pick(wait_s=30)  # the watch reported the serving one
        picks = {await pool.pick(wait_s=0) for _ in range(6)}
        assert picks == {f"127.0.0.1:{up_port}"}
    finally:
        await pool.close()
        await server.stop(None)


@pytest.mark.asyncio
async def test_not_serving_replica_is_passed_over_and_none_left_means_no_healthy_upstream():
    port = free_port()
    server, _ = await health_server(port, health_pb2.HealthCheckResponse.NOT_SERVING)
    pool = Pool("tokenizer", (f"127.0.0.1:{port}",), 1 << 20)
    pool.start()
    try:
        with pytest.raises(errors.NotReady) as exc:
            await pool.pick(wait_s=0.3)
        assert exc.value.reason == "NO_HEALTHY_UPSTREAM"
    finally:
        await pool.close()
        await server.stop(None)


@pytest.mark.asyncio
async def test_waits_for_a_replica_that_comes_back_within_the_wait():
    port = free_port()
    pool = Pool("tokenizer", (f"127.0.0.1:{port}",), 1 << 20)
    pool.start()
    server = None
    try:
        async def come_back_later():
            nonlocal server
            await asyncio.sleep(0.5)
            server, _ = await health_server(port)
        task = asyncio.create_task(come_back_later())
        assert await pool.pick(wait_s=10) == f"127.0.0.1:{port}"
        await task
    finally:
        await pool.close()
        if server is not None:
            await server.stop(None)


@pytest.mark.asyncio
async def test_calls_reach_every_worker_sharing_a_port():
    """Two workers on one port (SO_REUSEPORT, as the tokenizer runs): the kernel hands each new
    connection to one of them, so calls over a single connection would all land on one worker."""
    port = free_port()
    workers = [await serve(port, "pid", reuse_port=True) for _ in range(2)]
    pool = Pool("tokenizer", (f"127.0.0.1:{port}",), 1 << 20, channels_per_replica=16)
    pool.start()
    try:
        for _ in range(32):
            await pool.call(30, lambda stub, t: stub.Encode(tokenizer_pb2.EncodeRequest(text=b"hi"), timeout=t))
    finally:
        await pool.close()
        for server, _ in workers:
            await server.stop(None)
    calls = [servicer.calls for _, servicer in workers]
    assert sum(calls) == 32 and min(calls) > 0, calls


@pytest.mark.asyncio
async def test_gateway_is_ready_while_its_upstreams_are_down():
    """Requests are held for a replica within their deadlines, so no upstream being up yet does not
    keep the gateway from reporting SERVING (its warm-up returns)."""
    cfg = gateway_config.load()
    down = gateway_config.Upstreams(**{s: (f"127.0.0.1:{free_port()}",) for s in GATEWAY_UPSTREAMS})
    stage = GatewayStage(replace(cfg, upstreams=down))
    try:
        await asyncio.wait_for(stage.warmup(), 30)
    finally:
        await stage.close()
