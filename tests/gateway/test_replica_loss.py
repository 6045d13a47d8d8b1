"""The gateway's transport and retry executor against real tokenizer replicas (tests/gateway/
tokenizer_stub.py) that die, come back, or fail while alive:

- a call in flight on a process killed -9 is re-dispatched once, to the restarted replica, and the
  re-dispatch costs no retry token (a throttle that allows no retry at all still lets it through);
- with no replica SERVING, a request is held for its whole deadline (woken by the health watch),
  then answered NO_HEALTHY_UPSTREAM with a retry hint;
- the A6 throttle still stops the retries against a live replica that keeps failing.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from keel.tokenizer.v1 import tokenizer_pb2
from services.gateway.balancer import RoundRobinBalancer
from services.gateway.budget import ThrottleConfig
from services.gateway.pool import Pool
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.upstreams import MeshUpstreams
from shared import errors
from testing.mesh import ROOT
from testing.ports import free_port
from tests.gateway.tokenizer_stub import serve

pytestmark = pytest.mark.slow

ENCODE = tokenizer_pb2.EncodeRequest(text=b"hi")


def replica(port: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.gateway.tokenizer_stub", str(port), mode], cwd=ROOT)


async def encode(pool: Pool, executor: RetryExecutor, timeout_s: float):
    async def attempt(timeout: float, md: dict):
        return await pool.call(timeout, lambda stub, t: stub.Encode(ENCODE, timeout=t))
    return await executor.call_with_retries(attempt, method="Encode", upstream="tokenizer", idempotent=True,
                                            deadline=time.monotonic() + timeout_s, trace_id="t")


def executor(max_tokens: float = 10.0) -> RetryExecutor:
    return RetryExecutor(RetryConfig(base_s=0.01, cap_s=0.02, throttle=ThrottleConfig(max_tokens=max_tokens)))


@pytest.mark.asyncio
async def test_call_on_a_killed_replica_is_redispatched_to_the_restarted_one_without_a_retry_token():
    port = free_port()
    first = replica(port, "hang")
    restarted = None
    pool = Pool("tokenizer", (f"127.0.0.1:{port}",), 1 << 20)
    pool.start()
    ex = executor(max_tokens=1)  # a throttle with no retry to give: 1 token, retries need > 0.5 after a failure
    try:
        await pool.pick(30)  # the replica is SERVING
        call = asyncio.create_task(encode(pool, ex, 60))
        await asyncio.sleep(0.5)  # the call is in flight on the hanging replica
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        await asyncio.sleep(0.5)
        restarted = replica(port, "pid")  # what the supervisor does
        resp = await call
        assert list(resp.input_ids) == [restarted.pid]
        assert ex.throttles.get("tokenizer").tokens == 1.0
    finally:
        await pool.close()
        for p in (first, restarted):
            if p is not None:
                p.kill()
                p.wait()


@pytest.mark.asyncio
async def test_with_no_replica_the_request_is_held_past_five_seconds_until_one_serves():
    port = free_port()
    mesh = MeshUpstreams({"tokenizer": (f"127.0.0.1:{port}",), "inference": (f"127.0.0.1:{free_port()}",),
                          "validator": (f"127.0.0.1:{free_port()}",)}, 1 << 20, channels_per_replica=1)
    mesh.start()
    late = None
    try:
        async def start_late():
            nonlocal late
            await asyncio.sleep(6)
            late = replica(port, "pid")
        starter = asyncio.create_task(start_late())
        encoded = await mesh.encode_chat((("user", "hi"),), 64, timeout=60, md={})
        await starter
        assert encoded.ids == [late.pid]
    finally:
        await mesh.close()
        if late is not None:
            late.kill()
            late.wait()


@pytest.mark.asyncio
async def test_held_request_ends_at_its_deadline_with_no_healthy_upstream_and_a_hint():
    pool = Pool("tokenizer", (f"127.0.0.1:{free_port()}",), 1 << 20)
    pool.start()
    try:
        with pytest.raises(errors.NotReady) as info:
            await encode(pool, executor(), 1.0)
    finally:
        await pool.close()
    assert info.value.reason == "NO_HEALTHY_UPSTREAM" and info.value.retry_after_ms > 0


@pytest.mark.asyncio
async def test_throttle_still_stops_retries_against_a_live_failing_replica():
    port = free_port()
    server, servicer = await serve(port, "fail")
    pool = Pool("tokenizer", (f"127.0.0.1:{port}",), 1 << 20)
    # Re-admit the failing replica at once, so each request reaches it instead of waiting to.
    pool.balancer = RoundRobinBalancer("tokenizer", pool.targets, readmit_after_s=0.001)
    pool.start()
    ex = executor()
    stops = []
    try:
        await pool.pick(30)
        for _ in range(10):
            with pytest.raises(errors.NotReady) as info:
                await encode(pool, ex, 30)
            assert info.value.reason == "TEST_FAILING"
            stops.append(info.value.metadata["retry_stop"])
    finally:
        await pool.close()
        await server.stop(None)
    assert "budget" in stops and stops[-1] == "budget"
    assert servicer.calls < 3 * 10  # the throttle, not the per-request cap, ended the storm
