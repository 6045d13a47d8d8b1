"""Precise routing: one inference replica's WatchCache stream feeding the gateway's `Router` with
what that replica's prefix cache holds and how loaded it is (services/inference/servicer.py sends it).

The stream opens with a snapshot (every block key held, and the replica's instance id: another id
than before means it restarted), then block changes and loads. While it is up the router uses the
replica's own report; when it ends or breaks the router falls back to its approximate record and the
stream is opened again. A replica that has no WatchCache (an older build) or another block size than
the router's stays on the record.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from keel.inference.v1 import inference_pb2
from services.gateway.routing import Router
from shared import client

log = logging.getLogger("keel.gateway.cachewatch")
REOPEN_S = 1.0  # between a stream's end and the next try (the replica restarting, say)


def apply(router: Router, replica: str, ev: inference_pb2.CacheEvent) -> bool:
    """One stream message into the router; False when the replica's blocks are not the router's."""
    kind = ev.WhichOneof("event")
    if kind == "snapshot":
        if ev.snapshot.block_tokens != router.cfg.block_tokens:
            log.warning("replica's prefix blocks differ from routing.block_tokens: routing it approximately",
                        extra={"endpoint": replica, "replica_block_tokens": ev.snapshot.block_tokens,
                               "block_tokens": router.cfg.block_tokens})
            return False
        router.index.reported(replica, ev.snapshot.instance_id, list(ev.snapshot.keys))
    elif kind == "blocks":
        router.index.changed(replica, list(ev.blocks.stored), list(ev.blocks.evicted))
    elif kind == "load":
        router.reported_loads[replica] = ev.load.running_tokens + ev.load.queued_tokens
    return True


async def follow(router: Router, replica: str, stub, serving: Callable[[], Awaitable[None]]) -> None:
    """Keep `router` following `replica`'s stream (an InferenceStub's WatchCache) until cancelled;
    each stream is opened once `serving()` returns (the replica's health says SERVING: before that,
    warming up, it would refuse it)."""
    while True:
        await serving()
        try:
            call = stub.WatchCache(inference_pb2.WatchCacheRequest(), wait_for_ready=True,
                                   metadata=client.mesh_metadata())
            async for ev in call:
                if not apply(router, replica, ev):
                    call.cancel()
                    router.stream_down(replica)
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("replica has no WatchCache: routing it approximately", extra={"endpoint": replica})
                router.stream_down(replica)
                return
        router.stream_down(replica)
        await asyncio.sleep(REOPEN_S)
