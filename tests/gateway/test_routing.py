"""Routing among inference replicas: the decision as a pure function (prefix, imbalance, miss, the
other policies), the index (chained keys, LRU, forgetting a restarted replica), the loads, and the
gateway's upstreams sending requests that share a prefix to one of two real in-process replicas."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from services.gateway.balancer import RoundRobinBalancer
from services.gateway.contract import Ask
from services.gateway.routing import (
    POLICIES,
    Decision,
    PrefixIndex,
    Router,
    RoutingConfig,
    block_keys,
    decide,
    imbalanced,
)
from services.gateway.upstreams import MeshUpstreams
from services.gateway.values import Done, Encoded
from shared.stages import SERVICE_NAMES
from testing.ports import free_port

CFG = RoutingConfig(block_tokens=4, blocks_per_replica=8, imbalance_abs_tokens=100, imbalance_ratio=2.0)
A, B, C = "a:1", "b:1", "c:1"


def test_keys_chain_whole_blocks_and_leave_the_last_token_out():
    ids = list(range(13))
    keys = block_keys(ids, 4, "")
    assert len(keys) == 3  # (13 - 1) // 4: the last token is always computed
    assert len(block_keys(ids[:12], 4, "")) == 2
    # A key names the whole prefix: the same block after a different first block has another key.
    other = block_keys([99] + ids[1:], 4, "")
    assert other[0] != keys[0] and other[1] != keys[1]
    assert block_keys(ids, 4, "") == keys
    assert block_keys(ids, 4, "tuned@1") != keys  # the adapter is part of the key
    assert block_keys([], 4, "") == [] and block_keys([1], 4, "") == []


def test_longest_cached_prefix_wins():
    d = decide([A, B, C], {A: 1, B: 3, C: 2}, {A: 10, B: 50, C: 0}, CFG)
    assert d == Decision(B, "prefix", 3, "prefix_affinity")


def test_tie_on_prefix_goes_to_the_least_loaded():
    assert decide([A, B], {A: 2, B: 2}, {A: 30, B: 5}, CFG) == Decision(B, "prefix", 2, "prefix_affinity")


def test_miss_goes_to_the_least_loaded_not_the_rotation():
    assert decide([A, B, C], {}, {A: 30, B: 5, C: 9}, CFG) == Decision(B, "miss", 0, "prefix_affinity")
    assert decide([A, B], {A: 0, B: 0}, {}, CFG) == Decision(A, "miss", 0, "prefix_affinity")


def test_imbalance_sends_to_the_least_loaded_over_the_cache():
    loads = {A: 500, B: 100}
    assert imbalanced(list(loads.values()), CFG)
    assert decide([A, B], {A: 5}, loads, CFG) == Decision(B, "imbalanced", 0, "prefix_affinity")


@pytest.mark.parametrize("loads", [{A: 150, B: 100},    # differ by less than the absolute threshold
                                   {A: 1150, B: 1000}])  # by more, but within the ratio
def test_within_either_threshold_the_cache_decides(loads):
    assert not imbalanced(list(loads.values()), CFG)
    assert decide([A, B], {A: 5}, loads, CFG) == Decision(A, "prefix", 5, "prefix_affinity")


def test_other_policies():
    loads, matched = {A: 30, B: 5}, {A: 3}
    rr = RoutingConfig(policy="round_robin")
    ll = RoutingConfig(policy="least_loaded")
    assert decide([A, B], matched, loads, rr) == Decision(A, "round_robin", 3, "round_robin")
    assert decide([A, B], matched, loads, ll) == Decision(B, "least_loaded", 0, "least_loaded")
    assert set(POLICIES) == {"prefix_affinity", "least_loaded", "round_robin"}


def test_index_matches_from_the_first_block_and_forgets_least_recent_first():
    index = PrefixIndex(blocks_per_replica=4)
    keys = block_keys(list(range(17)), 4, "")   # 4 blocks
    index.record(A, keys[:2])
    assert index.matched(A, keys) == 2 and index.matched(B, keys) == 0
    index.record(A, keys)
    other = block_keys([7] * 9, 4, "")          # 2 more blocks push the 2 oldest out
    index.record(A, other)
    assert index.matched(A, other) == 2
    assert index.matched(A, keys) == 0          # its first block went: nothing after it counts
    index.forget(A)
    assert index.matched(A, other) == 0


def test_router_counts_tokens_in_flight_and_records_the_prompt():
    seen: list[Decision] = []
    router = Router(CFG, on_decision=seen.append)
    ids = list(range(9))
    first = router.plan(ids, "", max_tokens=10)
    assert router.choose(first)([A, B]) == A        # nothing cached: least loaded, the first on a tie
    router.started(A, first)
    assert router.loads == {A: 19}
    second = router.plan(ids, "", max_tokens=10)
    assert router.choose(second)([A, B]) == A       # A holds its 2 blocks
    assert second.decision == Decision(A, "prefix", 2, "prefix_affinity")
    router.started(A, second)
    router.ended(A, first)
    router.ended(A, second)
    assert router.loads == {}
    assert [d.reason for d in seen] == ["miss", "prefix"]


def test_balancer_chooser_sees_only_eligible_replicas_in_rotation_order():
    t = [0.0]
    b = RoundRobinBalancer("inference", [A, B, C], readmit_after_s=5, clock=lambda: t[0])
    b.mark_down(B)
    offered: list[list[str]] = []
    assert b.pick(lambda c: offered.append(list(c)) or c[-1]) == C
    assert offered == [[A, C]]
    assert b.pick() == A  # the rotation goes on after the chosen one
    assert b.pick(skip={C}) == A  # C passed over (and marked down)
    assert B not in b.healthy() and C not in b.healthy()


class Replica(inference_pb2_grpc.InferenceServicer):
    """An inference replica that answers every Generate with one finished event, counting its calls."""

    def __init__(self):
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        await asyncio.sleep(0.01)
        yield inference_pb2.GenerateEvent(finished=inference_pb2.Finished(finish_reason="stop"))


async def replica(port: int) -> tuple[grpc.aio.Server, Replica]:
    server, servicer = grpc.aio.server(), Replica()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    h = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await h.set(SERVICE_NAMES["inference"], health_pb2.HealthCheckResponse.SERVING)
    return server, servicer


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["prefix_affinity", "round_robin"])
async def test_requests_sharing_a_prefix_go_to_one_replica(policy):
    ports = [free_port(), free_port()]
    started = [await replica(p) for p in ports]
    targets = tuple(f"127.0.0.1:{p}" for p in ports)
    router = Router(RoutingConfig(policy=policy, block_tokens=4))
    nowhere = (f"127.0.0.1:{free_port()}",)  # the other stages: not called
    up = MeshUpstreams({"tokenizer": nowhere, "validator": nowhere, "inference": targets}, 1 << 20, 1, router)
    up.start()
    try:
        await up.pools["inference"].pick(wait_s=30)
        while up.pools["inference"]._not_serving:  # both watches reported SERVING
            await asyncio.sleep(0.05)
        system = list(range(100, 140))
        for turn in range(6):
            enc = Encoded(system + [turn] * 5, False, 45, "fp")
            events = [ev async for ev in up.generate(enc, Ask((("user", "hi"),), 8), 0, 10, {})]
            assert isinstance(events[-1], Done)
        calls = sorted(s.calls for _, s in started)
        # prefix_affinity: every turn on the replica that holds the system prompt; round robin splits them.
        assert calls == ([0, 6] if policy == "prefix_affinity" else [3, 3])
        assert router.loads == {}
    finally:
        await up.close()
        for server, _ in started:
            await server.stop(None)


def test_a_single_replica_gets_no_router():
    router = Router(RoutingConfig())
    up = MeshUpstreams({"tokenizer": ("x:1",), "validator": ("x:1",), "inference": ("a:1",)}, 1 << 20, 1, router)
    assert up.pools["inference"].router is None
