"""Chunked prefill in the engine: a long prompt is prefilled prefill_tokens_per_iteration tokens per
step, while the running rows keep decoding."""
from __future__ import annotations

import asyncio

import pytest

from services.inference.engine.api import TokenEvent
from tests.inference.helpers import collect, ids, prompt, request

CHUNK = 64


@pytest.mark.asyncio
async def test_running_rows_keep_decoding_while_a_long_prompt_is_prefilled_in_chunks(make_engine):
    engine = await make_engine(prefill_tokens_per_iteration=CHUNK)
    running = engine.generate(request("run", prompt(1), max_tokens=200))
    await running.__anext__()
    seen_while_prefilling = 0
    long_task = asyncio.create_task(collect(engine, request("long", prompt(2, 600), max_tokens=2)))
    async for item in running:
        if long_task.done():
            break
        if isinstance(item, TokenEvent):
            seen_while_prefilling += 1
    await running.aclose()
    tokens, fin = await long_task
    assert len(tokens) == 2 and fin.prompt_tokens == 600
    # 600 tokens take ceil(600 / 64) = 10 steps; the running row gets a token from each of them.
    assert seen_while_prefilling >= 600 // CHUNK


@pytest.mark.asyncio
async def test_chunked_requests_are_batch_invariant_and_greedy_matches_whole_prefill(make_engine):
    chunked = await make_engine(prefill_tokens_per_iteration=CHUNK)
    whole = await make_engine()
    reqs = [request(f"r{i}", prompt(i, 150 + 37 * i), max_tokens=6) for i in range(4)]
    alone = [await collect(chunked, r) for r in reqs]
    together = await asyncio.gather(*(collect(chunked, r) for r in reqs))
    for (a, _), (b, _) in zip(alone, together):
        assert ids(a) == ids(b) and [t.logprob for t in a] == [t.logprob for t in b]
    assert [ids(a) for a, _ in alone] == [ids((await collect(whole, r))[0]) for r in reqs]
