"""Prefix cache: full prompt blocks computed once are reused, bitwise, within their share of the budget."""
from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference.engine.prefix import PrefixCache
from services.inference.model.forward import LlamaRunner
from services.inference.model.kvpool import KvPool
from tests.inference.helpers import collect, find, prompt, put, request

BLOCK = 32


def pool_of(blocks: int) -> KvPool:
    """A pool whose blocks are whole prefix blocks (one pool block per cached prompt block)."""
    return KvPool(n_layers=2, kv_heads=2, head_dim=4, block_tokens=BLOCK, blocks=blocks, dtype=torch.float32,
                  device=torch.device("cpu"))


def test_a_block_is_found_only_after_the_same_whole_prefix_and_one_token_is_always_left():
    pool = pool_of(4)
    cache = PrefixCache(BLOCK, 10**6)
    ids = prompt(1, 3 * BLOCK)
    row = pool.allocate(3 * BLOCK)
    for i in range(3):
        put(cache, "primary", "", ids, i, pool, row.blocks[i:i + 1])
    assert len(find(cache, "primary", "", ids)) == 2                     # the last block holds the last token
    assert find(cache, "primary", "", ids + [5]) == [[b] for b in row.blocks]
    assert find(cache, "primary", "", [7] + ids[1:]) == []                # block 0 differs: nothing after it
    assert find(cache, "fallback", "", ids + [5]) == []                   # another runner's numerics
    stats = cache.stats()
    assert stats.hit_tokens == (2 + 3) * BLOCK and stats.prompt_tokens == 4 * (3 * BLOCK) + 2
    assert stats.hit_rate == pytest.approx(stats.hit_tokens / stats.prompt_tokens)
    assert stats.bytes == 3 * pool.block_bytes


def test_cached_blocks_stay_lent_until_the_cache_and_every_row_let_go():
    pool = pool_of(4)
    cache = PrefixCache(BLOCK, 2 * pool.block_bytes)
    a, b, c = prompt(1, BLOCK + 1), prompt(2, BLOCK + 1), prompt(3, BLOCK + 1)
    first = pool.allocate(BLOCK)
    put(cache, "primary", "", a, 0, pool, first.blocks)
    first.release()                                                    # the row ended: the cache holds it
    assert pool.free_blocks == 3
    hit = pool.allocate(2 * BLOCK)                                     # a later row with the same prefix
    own = hit.blocks[0]
    hit.adopt(0, find(cache, "primary", "", a)[0])
    assert hit.blocks[0] != own and pool.free_blocks == 2              # its own first block went back
    second = pool.allocate(BLOCK)
    put(cache, "primary", "", b, 0, pool, second.blocks)
    assert len(find(cache, "primary", "", a)) == 1                        # a is now the most recently used
    third = pool.allocate(BLOCK)
    put(cache, "primary", "", c, 0, pool, third.blocks)                   # evicts b, not a
    assert [len(find(cache, "primary", "", p)) for p in (a, b, c)] == [1, 0, 1]
    assert cache.bytes == 2 * pool.block_bytes and cache.stats().entries == 2
    put(cache, "primary", "", prompt(4, BLOCK + 1), 0, pool, second.blocks)  # evicts a: the hit row still holds it
    second.release()
    assert pool.free_blocks == 0
    hit.release()
    assert pool.free_blocks == 2                                       # a's block too, once nobody holds it


def test_a_block_cannot_be_shared_once_free():
    pool = pool_of(2)
    row = pool.allocate(BLOCK)
    block = row.blocks
    row.release()
    with pytest.raises(ValueError):
        put(PrefixCache(BLOCK, 10**6), "primary", "", prompt(1, BLOCK + 1), 0, pool, block)


@pytest.mark.asyncio
async def test_an_answer_with_a_prefix_hit_is_bitwise_the_one_without(make_engine, tiny):
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * BLOCK
    cached = await make_engine(prefill_tokens_per_iteration=BLOCK, prefix_cache_bytes=8 * block_bytes)
    plain = await make_engine(prefill_tokens_per_iteration=BLOCK)
    shared = prompt(5, 3 * BLOCK)
    first = request("first", shared + prompt(6, 10), max_tokens=4)
    second = request("second", shared + prompt(7, 13), max_tokens=8, temperature=0.9, seed=3)
    await collect(cached, first)
    hit, _ = await collect(cached, second)
    miss, _ = await collect(plain, second)
    assert [(t.token_id, t.logprob, t.entropy) for t in hit] == [(t.token_id, t.logprob, t.entropy) for t in miss]
    stats = cached.stats()
    assert stats.prefix_cache.hit_tokens == 3 * BLOCK
    assert stats.prefix_cache.hit_rate == pytest.approx(3 * BLOCK / (len(first.prompt_ids) + len(second.prompt_ids)))
    assert stats.prefix_cache.bytes <= 8 * block_bytes
    assert stats.memory.predicted_bytes == stats.memory.static_bytes + 8 * block_bytes  # the room stays kept


@pytest.mark.asyncio
async def test_a_hit_reads_the_cached_blocks_in_place_and_leaves_them_unchanged(make_engine, tiny):
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * BLOCK
    engine = await make_engine(prefill_tokens_per_iteration=BLOCK, prefix_cache_bytes=8 * block_bytes)
    pool = engine.primary_runner.pool
    shared = prompt(5, 2 * BLOCK)
    await collect(engine, request("first", shared + prompt(6, 10), max_tokens=4))
    prefix = engine._loop.kv.prefix
    held = sorted(b for key in prefix._entries for b in prefix._entries[key][1])
    assert len(held) == 2 * BLOCK // pool.block_tokens and pool.free_blocks == pool.blocks - len(held)
    before = pool.keys[:, :, held].clone(), pool.values[:, :, held].clone()
    tables = []
    async for item in engine.generate(request("second", shared + prompt(7, 13), max_tokens=40)):
        tables += [list(r.cache.blocks) for r in engine._loop.scheduler.rows]
    assert tables and all(sorted(t[:len(held)]) == held for t in tables)  # the row's table holds them
    assert engine.stats().prefix_cache.hit_tokens == 2 * BLOCK
    assert torch.equal(pool.keys[:, :, held], before[0]) and torch.equal(pool.values[:, :, held], before[1])
    assert pool.free_blocks == pool.blocks - len(held)                 # every row's blocks came back


@pytest.mark.asyncio
async def test_choices_of_one_prompt_sent_at_once_compute_its_blocks_once(make_engine, tiny):
    """OpenAI's `n`: the choices arrive together; the later ones wait for the blocks the first computes
    (schedule.py, held) and find them cached, and each answer is the one it gives alone."""
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * BLOCK
    cached = await make_engine(prefill_tokens_per_iteration=BLOCK, prefix_cache_bytes=8 * block_bytes)
    plain = await make_engine(prefill_tokens_per_iteration=BLOCK)
    shared = prompt(5, 3 * BLOCK + 7)
    choices = [request(f"choice{i}", shared, max_tokens=6, temperature=0.9, seed=i) for i in range(3)]
    together = await asyncio.gather(*(collect(cached, r) for r in choices))
    for r, (tokens, _) in zip(choices, together):
        alone, _ = await collect(plain, r)
        assert [(t.token_id, t.logprob) for t in tokens] == [(t.token_id, t.logprob) for t in alone]
    assert cached.stats().prefix_cache.hit_tokens == 2 * 3 * BLOCK  # choices 1 and 2 found all three blocks
