"""What a stage's server exposes, on a real server in this process: metrics listen on the stage's
configured host (never every interface), and a client connection left idle is closed."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import psutil
import pytest

from shared.config import ServerConfig
from shared.server import serve
from testing.ports import free_port
from tests.shared.stage_stub import HangingStage, serving


async def stop(server: asyncio.Task) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # only the serving loop's handler sees it
    await asyncio.wait_for(server, 30)


def listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.mark.asyncio
async def test_metrics_bind_the_configured_host():
    port, metrics_port = free_port(), free_port()
    server = asyncio.create_task(serve(HangingStage(), ServerConfig(port=port, metrics_port=metrics_port,
                                                                    drain_grace_s=0)))
    await asyncio.wait_for(serving(port), 30)
    try:
        assert listening_on(metrics_port) == {"127.0.0.1"}
    finally:
        await stop(server)


@pytest.mark.asyncio
async def test_an_idle_client_connection_is_closed():
    port = free_port()
    server = asyncio.create_task(serve(HangingStage(), ServerConfig(port=port, drain_grace_s=0,
                                                                    max_connection_idle_s=0.5)))
    await asyncio.wait_for(serving(port), 30)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await ch.channel_ready()
            assert ch.get_state() == grpc.ChannelConnectivity.READY
            # No call on it: the server closes the connection (GOAWAY) and the channel goes idle.
            await asyncio.wait_for(ch.wait_for_state_change(grpc.ChannelConnectivity.READY), 30)
            assert ch.get_state() == grpc.ChannelConnectivity.IDLE
    finally:
        await stop(server)


@pytest.mark.asyncio
async def test_a_warmed_up_stage_keeps_its_startup_heap_out_of_the_collector():
    """What the process entry asks for (``freeze``): once SERVING, the objects alive at the end of
    warm-up are frozen, so a full collection under load no longer walks them (and stops the loop)."""
    import gc
    gc.unfreeze()
    port = free_port()
    server = asyncio.create_task(serve(HangingStage(), ServerConfig(port=port, drain_grace_s=0), freeze=True))
    try:
        await asyncio.wait_for(serving(port), 30)
        assert gc.get_freeze_count() > 1000
    finally:
        await stop(server)
        gc.unfreeze()


@pytest.mark.asyncio
async def test_a_stage_served_without_freeze_leaves_the_heap_to_the_collector():
    import gc
    gc.unfreeze()
    port = free_port()
    server = asyncio.create_task(serve(HangingStage(), ServerConfig(port=port, drain_grace_s=0)))
    try:
        await asyncio.wait_for(serving(port), 30)
        assert gc.get_freeze_count() == 0
    finally:
        await stop(server)
