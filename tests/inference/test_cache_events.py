"""The prefix cache's events (WatchCache): every block stored or evicted is told to each watch under
the key the gateway's router computes for the same tokens, a watch that falls behind gets a snapshot
instead, and the servicer streams them with the replica's instance id and its load."""
from __future__ import annotations

import asyncio

import pytest
import torch

from keel.inference.v1 import inference_pb2
from services.gateway.routing import block_keys
from services.inference.engine.cachewatch import CacheWatch
from services.inference.engine.prefix import PrefixCache
from services.inference.model.forward import LlamaRunner
from services.inference.model.kvpool import KvPool
from services.inference.servicer import InferenceServicer
from shared import metrics
from tests.inference.helpers import collect, prompt, put, request

BLOCK = 32


def pool_of(blocks: int) -> KvPool:
    return KvPool(n_layers=2, kv_heads=2, head_dim=4, block_tokens=BLOCK, blocks=blocks, dtype=torch.float32,
                  device=torch.device("cpu"))


@pytest.mark.asyncio
async def test_a_watch_hears_stores_and_evictions_under_the_routers_keys():
    pool = pool_of(8)
    cache = PrefixCache(BLOCK, 3 * pool.block_bytes)
    watch = CacheWatch(capacity=16, loop=asyncio.get_running_loop())
    cache.watch(watch)
    assert await watch.take(1) == ([], {})                       # first: everything held (nothing yet)
    a, b, c, d = prompt(1, 2 * BLOCK + 1), prompt(2, BLOCK + 1), prompt(3, BLOCK + 1), prompt(4, BLOCK + 1)
    row = pool.allocate(2 * BLOCK)
    for i in range(2):
        put(cache, "primary", "tuned@1", a, i, pool, row.blocks[i:i + 1])
    keys = block_keys(a, BLOCK, "tuned@1")
    assert await watch.take(1) == (None, {keys[0]: True, keys[1]: True})
    put(cache, "fallback", "tuned@1", a, 0, pool, row.blocks[:1])  # another runner, the same key: no news
    rows = [pool.allocate(BLOCK) for _ in range(4)]
    for p, r in zip((b, c, d), rows):                            # each evicts the oldest entry
        put(cache, "primary", "", p, 0, pool, r.blocks)
        _, changes = await watch.take(1)
        assert changes.pop(block_keys(p, BLOCK, "")[0]) is True
        # b evicts primary's a0 (fallback still holds that key: no news), c evicts a1, d fallback's a0
        assert changes == {p is b: {}, p is c: {keys[1]: False}, p is d: {keys[0]: False}}[True]
    watch.close()
    put(cache, "primary", "", prompt(5, BLOCK + 1), 0, pool, rows[3].blocks)
    assert cache._watches == []                                  # a closed watch is dropped


@pytest.mark.asyncio
async def test_a_watch_that_falls_behind_gets_a_snapshot_not_the_changes():
    pool = pool_of(8)
    cache = PrefixCache(BLOCK, 8 * pool.block_bytes)
    watch = CacheWatch(capacity=2, loop=asyncio.get_running_loop())
    cache.watch(watch)
    await watch.take(1)
    ids = prompt(1, 4 * BLOCK + 1)
    row = pool.allocate(4 * BLOCK)
    for i in range(4):
        put(cache, "primary", "", ids, i, pool, row.blocks[i:i + 1])
    snapshot, changes = await watch.take(1)
    keys = block_keys(ids, BLOCK, "")
    assert set(snapshot) == set(keys[:3]) and changes == {keys[3]: True}  # resynced at the third, then one change


@pytest.mark.asyncio
async def test_the_engine_tells_a_watch_the_blocks_a_request_stores_and_evicts(make_engine, tiny):
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * BLOCK
    engine = await make_engine(prefill_tokens_per_iteration=BLOCK, prefix_cache_bytes=2 * block_bytes)
    watch = engine.watch_cache(64)
    assert await watch.take(5) == ([], {})
    first = request("first", prompt(5, 2 * BLOCK + 3), max_tokens=2)
    await collect(engine, first)
    keys = block_keys(first.prompt_ids, BLOCK, "")               # what the gateway computes for this prompt
    assert await watch.take(5) == (None, {k: True for k in keys})
    second = request("second", prompt(6, BLOCK + 3), max_tokens=2)
    await collect(engine, second)                                # its block evicts the first's oldest
    assert await watch.take(5) == (None, {keys[0]: False, block_keys(second.prompt_ids, BLOCK, "")[0]: True})


@pytest.mark.asyncio
async def test_the_servicer_streams_a_snapshot_with_the_instance_then_blocks_and_load(make_engine, tiny):
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * BLOCK
    engine = await make_engine(prefill_tokens_per_iteration=BLOCK, prefix_cache_bytes=4 * block_bytes)
    servicer = InferenceServicer(engine, metrics.metrics_for("inference"))
    stream = servicer.WatchCache(inference_pb2.WatchCacheRequest(), None)
    first = await anext(stream)
    assert first.snapshot.instance_id == engine.instance_id and first.snapshot.block_tokens == BLOCK
    assert list(first.snapshot.keys) == []
    load = (await anext(stream)).load
    assert load == inference_pb2.CacheLoad(free_kv_blocks=engine.stats().free_kv_blocks) and load.free_kv_blocks > 0
    req = request("one", prompt(5, BLOCK + 3), max_tokens=2)
    await collect(engine, req)
    ev = await anext(stream)
    while not ev.HasField("blocks"):
        ev = await anext(stream)
    assert list(ev.blocks.stored) == block_keys(req.prompt_ids, BLOCK, "")
    servicer.end_watches()
    rest = await asyncio.wait_for(_rest(stream), 10)             # the stream ends once the stage drains
    assert not any(e.HasField("snapshot") for e in rest)


async def _rest(stream) -> list:
    return [e async for e in stream]
