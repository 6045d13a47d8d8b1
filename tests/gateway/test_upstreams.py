"""The gateway's replica pool against real in-process health servers: pick only SERVING replicas,
wait (bounded) for one to come back, and give up with NO_HEALTHY_UPSTREAM."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.upstreams import SERVICES, Pool
from shared import errors
from tests.conftest import free_port


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
        assert await pool.any_serving()
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
