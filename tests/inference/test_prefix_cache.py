"""Prefix cache: full prompt blocks computed once are reused, bitwise, within their share of the budget."""
from __future__ import annotations

import pytest
import torch

from services.inference.forward import LlamaRunner
from services.inference.prefix import PrefixCache
from tests.inference.helpers import collect, prompt, request

BLOCK = 32


def block(value: float) -> torch.Tensor:
    return torch.full((2, 2, BLOCK, 4), value)


def test_a_block_is_found_only_after_the_same_whole_prefix_and_one_token_is_always_left():
    cache = PrefixCache(BLOCK, 10**6)
    ids = prompt(1, 3 * BLOCK)
    for i in range(3):
        cache.store("primary", ids, i, block(i), block(-i))
    assert len(cache.lookup("primary", ids)) == 2                     # the last block holds the last token
    assert len(cache.lookup("primary", ids + [5])) == 3
    assert cache.lookup("primary", [7] + ids[1:]) == []                # block 0 differs: nothing after it
    assert cache.lookup("fallback", ids + [5]) == []                   # another runner's numerics
    got = cache.lookup("primary", ids + [5])
    assert all(torch.equal(k, block(i)) and torch.equal(v, block(-i)) for i, (k, v) in enumerate(got))
    stats = cache.stats()
    assert stats.hit_tokens == (2 + 3 + 3) * BLOCK and stats.prompt_tokens == 5 * (3 * BLOCK) + 3
    assert stats.hit_rate == pytest.approx(stats.hit_tokens / stats.prompt_tokens)


def test_least_recently_used_blocks_leave_to_stay_within_capacity():
    size = 2 * block(0).nbytes
    cache = PrefixCache(BLOCK, 2 * size)
    a, b, c = prompt(1, BLOCK + 1), prompt(2, BLOCK + 1), prompt(3, BLOCK + 1)
    cache.store("primary", a, 0, block(1), block(1))
    cache.store("primary", b, 0, block(2), block(2))
    assert len(cache.lookup("primary", a)) == 1                        # a is now the most recently used
    cache.store("primary", c, 0, block(3), block(3))
    assert cache.bytes == 2 * size and cache.stats().entries == 2
    assert [len(cache.lookup("primary", p)) for p in (a, b, c)] == [1, 0, 1]


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
