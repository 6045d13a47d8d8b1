"""Precise routing: the router's index and loads follow each replica's WatchCache stream (snapshot,
stored, evicted, load), fall back to the gateway's own record while the stream is down, and forget a
replica that restarted (another instance id)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from services.gateway import cachewatch
from services.gateway.contract import Ask
from services.gateway.routing import MODES, Decision, Router, RoutingConfig, block_keys
from services.gateway.upstreams import MeshUpstreams
from services.gateway.values import Done, Encoded
from shared.stages import SERVICE_NAMES
from testing.ports import free_port

CFG = RoutingConfig(block_tokens=4, blocks_per_replica=64, imbalance_abs_tokens=100, imbalance_ratio=2.0)
A, B = "a:1", "b:1"
IDS = list(range(13))            # 3 blocks of 4
KEYS = block_keys(IDS, 4, "")


def snapshot(instance: str, keys=(), block_tokens: int = 4) -> inference_pb2.CacheEvent:
    return inference_pb2.CacheEvent(snapshot=inference_pb2.CacheSnapshot(instance_id=instance, keys=list(keys),
                                                                          block_tokens=block_tokens))


def blocks(stored=(), evicted=()) -> inference_pb2.CacheEvent:
    return inference_pb2.CacheEvent(blocks=inference_pb2.CacheBlocks(stored=list(stored), evicted=list(evicted)))


def load(running: int, queued: int) -> inference_pb2.CacheEvent:
    return inference_pb2.CacheEvent(load=inference_pb2.CacheLoad(running_tokens=running, queued_tokens=queued))


def routed(router: Router, replica: str, ids=IDS) -> None:
    """The gateway sent a request with `ids` to `replica` and it ended (its approximate record)."""
    route = router.plan(ids, "", 4)
    router.started(replica, route)
    router.ended(replica, route)


def test_the_index_follows_store_evict_and_snapshot_events():
    router = Router(CFG)
    routed(router, A)                                   # the record: A holds all 3 blocks
    assert router.index.matched(A, KEYS) == 3
    cachewatch.apply(router, A, snapshot("one"))        # A's report replaces the record: it holds nothing
    assert router.index.matched(A, KEYS) == 0
    cachewatch.apply(router, A, blocks(stored=KEYS))
    assert router.index.matched(A, KEYS) == 3
    cachewatch.apply(router, A, blocks(evicted=KEYS[1:2]))
    assert router.index.matched(A, KEYS) == 1           # a chain stops at the first block gone
    cachewatch.apply(router, A, snapshot("one", KEYS[:2]))  # a resync: exactly these now
    assert router.index.matched(A, KEYS) == 2
    cachewatch.apply(router, A, snapshot("one"))        # cleared
    assert router.index.matched(A, KEYS) == 0


def test_a_stream_that_drops_falls_back_to_the_record():
    router = Router(CFG)
    routed(router, A)
    cachewatch.apply(router, A, snapshot("one", KEYS[:1]))
    assert router.index.matched(A, KEYS) == 1
    router.stream_down(A)
    assert router.index.matched(A, KEYS) == 3           # what the gateway routed there
    cachewatch.apply(router, A, blocks(evicted=KEYS))   # a late message of the dead stream: ignored
    assert router.index.matched(A, KEYS) == 3


def test_a_restart_forgets_the_replicas_blocks_and_the_same_instance_keeps_them():
    router = Router(CFG)
    cachewatch.apply(router, A, snapshot("one"))
    routed(router, A)                                   # recorded while A's stream is up
    router.stream_down(A)
    cachewatch.apply(router, A, snapshot("one"))        # the same process again (a stream hiccup)
    router.stream_down(A)
    assert router.index.matched(A, KEYS) == 3           # its record kept
    cachewatch.apply(router, A, snapshot("two"))        # another process: restarted, cache empty
    router.stream_down(A)
    assert router.index.matched(A, KEYS) == 0           # the record went with it


def test_load_from_the_stream_decides_the_imbalance_rule():
    router = Router(CFG)
    for r in (A, B):
        cachewatch.apply(router, r, snapshot("x"))
    cachewatch.apply(router, A, blocks(stored=KEYS))
    route = router.plan(IDS, "", 4)
    assert router.choose(route)([A, B]) == A and route.decision.reason == "prefix"
    cachewatch.apply(router, A, load(running=400, queued=300))  # other gateways' requests on A
    cachewatch.apply(router, B, load(running=50, queued=0))
    route = router.plan(IDS, "", 4)
    assert router.choose(route)([A, B]) == B
    assert route.decision == Decision(B, "imbalanced", 0, "prefix_affinity")
    router.stream_down(A)                               # its reported load goes with its stream
    route = router.plan(IDS, "", 4)
    assert router.choose(route)([A, B]) == A


def test_a_replica_with_other_blocks_is_routed_approximately():
    router = Router(CFG)
    routed(router, A)
    assert not cachewatch.apply(router, A, snapshot("one", block_tokens=8))
    assert router.index.matched(A, KEYS) == 3


class FakeStub:
    """WatchCache: each call streams the next list of events, then breaks with UNAVAILABLE."""

    def __init__(self, streams: list[list[inference_pb2.CacheEvent]]):
        self.streams = streams
        self.calls = 0
        self.gate = asyncio.Event()   # released by the test once it has looked at the stream's effect

    def WatchCache(self, request, **kwargs):
        events = self.streams[self.calls]
        self.calls += 1
        return _Call(events, self.gate)


class _Call:
    def __init__(self, events, gate):
        self.events, self.gate = events, gate

    def cancel(self):
        pass

    async def __aiter__(self):
        for ev in self.events:
            yield ev
        await self.gate.wait()
        self.gate.clear()
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())


async def no_wait() -> None:
    """The replica's health: SERVING all along."""


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_follow_feeds_the_router_and_falls_back_when_the_stream_breaks(monkeypatch):
    monkeypatch.setattr(cachewatch, "REOPEN_S", 0)
    router = Router(CFG)
    routed(router, A)
    stub = FakeStub([[snapshot("one"), blocks(stored=KEYS[:2]), load(10, 5)], [snapshot("two")], []])
    task = asyncio.create_task(cachewatch.follow(router, A, stub, serving=no_wait))
    try:
        await settle()
        assert router.index.matched(A, KEYS) == 2 and router.load(A) == 15
        stub.gate.set()                                 # the stream breaks, is reopened: a new instance
        await settle()
        assert stub.calls == 2 and router.index.matched(A, KEYS) == 0
        stub.gate.set()                                 # breaks again: the record, which the restart cleared
        await settle()
        assert router.index.matched(A, KEYS) == 0 and router.reported_loads == {}
    finally:
        task.cancel()


def test_modes():
    assert MODES == ("precise", "approximate") and RoutingConfig().mode == "precise"
    assert Router(RoutingConfig()).follows_streams
    assert not Router(RoutingConfig(mode="approximate")).follows_streams
    assert not Router(RoutingConfig(policy="round_robin")).follows_streams


class Replica(inference_pb2_grpc.InferenceServicer):
    """An inference replica whose WatchCache reports `held` block keys; counts its Generate calls."""

    def __init__(self, held: list[bytes]):
        self.held, self.calls = held, 0

    async def WatchCache(self, request, context):
        yield snapshot(f"replica-{id(self)}", self.held)
        await asyncio.Event().wait()  # up until the gateway goes

    async def Generate(self, request, context):
        self.calls += 1
        yield inference_pb2.GenerateEvent(finished=inference_pb2.Finished(finish_reason="stop"))


@pytest.mark.asyncio
async def test_the_gateway_routes_by_what_a_replica_reports_over_grpc():
    system = list(range(100, 140))
    held = block_keys(system + [0], 4, "")             # the second replica holds the system prompt
    servers, replicas = [], [Replica([]), Replica(held)]
    for r in replicas:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(r, server)
        h = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await h.set(SERVICE_NAMES["inference"], health_pb2.HealthCheckResponse.SERVING)
        servers.append((server, f"127.0.0.1:{port}"))
    router = Router(RoutingConfig(block_tokens=4))
    nowhere = (f"127.0.0.1:{free_port()}",)
    up = MeshUpstreams({"tokenizer": nowhere, "validator": nowhere, "inference": tuple(t for _, t in servers)},
                       1 << 20, 1, router)
    up.start()
    try:
        while up.pools["inference"]._not_serving or len(router.index._reported) < 2:
            await asyncio.sleep(0.05)
        for turn in range(3):
            enc = Encoded(system + [turn] * 5, False, 45, "fp")
            done = [ev async for ev in up.generate(enc, Ask((("user", "hi"),), 8), 0, 10, {})][-1]
            assert isinstance(done, Done)                # its decision goes on to the replay record
            assert done.route == Decision(servers[1][1], "prefix", 10, "prefix_affinity")
        assert [r.calls for r in replicas] == [0, 3]
    finally:
        await up.close()
        for server, _ in servers:
            await server.stop(None)


def test_health_down_drops_the_record_and_a_gone_replica_everything():
    router = Router(CFG)
    routed(router, A)
    cachewatch.apply(router, A, snapshot("one", KEYS[:2]))
    cachewatch.apply(router, A, load(500, 0))
    router.index.forget(A)                              # its health left SERVING: the record goes
    assert router.index.matched(A, KEYS) == 2           # what its stream reports stands
    router.stream_down(A)
    assert router.index.matched(A, KEYS) == 0           # and no record stands in for it
    cachewatch.apply(router, A, snapshot("one", KEYS[:2]))
    router.forget(A)                                    # no longer a replica at all
    assert router.index.matched(A, KEYS) == 0 and router.load(A) == 0
