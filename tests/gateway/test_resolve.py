"""Replicas named by DNS (a Kubernetes headless Service): the pool opens a replica per address the
name resolves to, closes the ones gone (their routing index forgotten), and keeps what it knows when
the resolver fails."""
from __future__ import annotations

import asyncio

import pytest

from services.gateway import resolve
from services.gateway.pool import Pool
from services.gateway.routing import Router, RoutingConfig, block_keys
from services.gateway.upstreams import MeshUpstreams

NAME = "dns:///inference.keel.svc:50053"
A, B, C = "10.1.0.1:50053", "10.1.0.2:50053", "10.1.0.3:50053"


class FakeResolver:
    def __init__(self, *answers):
        self.answers = list(answers)   # each: a list of addresses, or an OSError to raise
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer


def test_a_dns_target_names_host_and_port():
    assert resolve.named(NAME) == ("inference.keel.svc", 50053)
    assert resolve.named("10.0.0.1:50053") is None


@pytest.mark.asyncio
async def test_expand_keeps_order_and_counts_each_replica_once():
    resolver = FakeResolver([B, A])
    assert await resolve.expand(("10.9.9.9:1", NAME, B), resolver) == ("10.9.9.9:1", B, A)
    assert resolver.asked == [("inference.keel.svc", 50053)]


@pytest.mark.asyncio
async def test_getaddrinfo_gives_addresses_with_the_port():
    assert "127.0.0.1:50053" in await resolve.getaddrinfo("localhost", 50053)


@pytest.mark.asyncio
async def test_the_pool_follows_the_pods_and_forgets_the_ones_gone():
    router = Router(RoutingConfig(block_tokens=4, mode="approximate"))
    resolver = FakeResolver([A, B], [A, C])
    pool = Pool("inference", (NAME,), 1 << 20, 1, router, resolver=resolver, resolve_every_s=3600)
    assert pool.targets == () and pool.balancer.endpoints == ()
    pool.start()
    try:
        await pool.refresh()                            # the start's own first resolution may race it: idempotent
        assert pool.targets == (A, B) and pool.balancer.endpoints == (A, B)
        assert set(pool.channels) == {A, B} and pool._not_serving >= {A, B}   # up once their health says so
        keys = block_keys(list(range(9)), 4, "")
        router.index.record(B, keys)
        await pool.refresh()                            # B's pod went, C's came
        assert pool.targets == (A, C) and set(pool.channels) == {A, C} and set(pool.stubs) == {A, C}
        assert B not in pool._watchers and router.index.matched(B, keys) == 0
    finally:
        await pool.close()


@pytest.mark.asyncio
async def test_a_failed_resolution_keeps_the_replicas_known():
    resolver = FakeResolver([A], OSError("no answer"))  # then it fails, again and again
    pool = Pool("inference", (NAME,), 1 << 20, 1, resolver=resolver, resolve_every_s=0.01)
    pool.start()
    try:
        await asyncio.wait_for(_asked(resolver, 3), 10)  # the loop goes on after a failure
        assert pool.targets == (A,) and set(pool.channels) == {A}
    finally:
        await pool.close()


async def _asked(resolver: FakeResolver, n: int) -> None:
    while len(resolver.asked) < n:
        await asyncio.sleep(0.01)


def test_a_dns_name_gets_the_router_as_it_may_stand_for_several():
    router = Router(RoutingConfig())
    up = MeshUpstreams({"tokenizer": ("x:1",), "validator": ("x:1",), "inference": (NAME,)}, 1 << 20, 1, router)
    assert up.pools["inference"].router is router
