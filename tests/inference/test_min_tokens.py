"""min_tokens and ignore_eos (vLLM's names) in the engine: the end ids masked until min_tokens, the
model's end ids not ending an answer that ignores them; rows beside rows that use neither unchanged."""
from __future__ import annotations

import asyncio

import pytest

from shared.controls import Controls
from shared.errors import InvalidInput
from tests.inference.helpers import collect, ids, prompt, request

MAX = 12


@pytest.mark.asyncio
async def test_min_tokens_masks_the_end_ids_and_ignore_eos_runs_to_max_tokens(make_engine):
    free = await make_engine(eos_token_ids=())
    greedy = ids((await collect(free, request("g", prompt(3), max_tokens=MAX)))[0])
    end = next(t for t in greedy[2:] if t not in greedy[:2])  # a token greedy decoding reaches at step >= 2
    first = greedy.index(end)
    engine = await make_engine(eos_token_ids=(end,))

    plain, fin = await collect(engine, request("p", prompt(3), max_tokens=MAX))
    assert ids(plain) == greedy[:first] and fin.finish_reason == "stop"  # the end id is not part of the text

    longer = first + 3
    tokens, fin = await collect(engine, request("m", prompt(3), max_tokens=MAX,
                                                controls=Controls(min_tokens=longer)))
    assert len(tokens) >= longer and end not in ids(tokens)[:longer]
    assert ids(tokens)[:first] == greedy[:first]  # nothing changes before the end id would have come

    ignoring, fin = await collect(engine, request("i", prompt(3), max_tokens=MAX, controls=Controls(ignore_eos=True)))
    assert ids(ignoring) == greedy and fin.finish_reason == "length"

    stop_id, fin = await collect(engine, request("s", prompt(3), max_tokens=MAX, stop_token_ids=(greedy[1],),
                                                 controls=Controls(min_tokens=4)))
    assert greedy[1] not in ids(stop_id)[:4]  # the request's stop ids are masked too


@pytest.mark.asyncio
async def test_a_row_with_min_tokens_leaves_its_batch_mates_bits_alone(make_engine):
    engine = await make_engine(eos_token_ids=(7,))
    alone = ids((await collect(engine, request("a", prompt(5), max_tokens=MAX, temperature=0.9, seed=3)))[0])
    together = await asyncio.gather(
        collect(engine, request("b", prompt(5), max_tokens=MAX, temperature=0.9, seed=3)),
        collect(engine, request("c", prompt(6), max_tokens=MAX, controls=Controls(min_tokens=MAX, ignore_eos=True))))
    assert ids(together[0][0]) == alone and len(together[1][0]) == MAX


@pytest.mark.asyncio
async def test_min_tokens_above_max_tokens_is_refused_with_its_reason(make_engine):
    engine = await make_engine()
    with pytest.raises(InvalidInput) as err:
        await collect(engine, request("x", prompt(1), max_tokens=4, controls=Controls(min_tokens=5)))
    assert err.value.reason == "MIN_TOKENS_OUT_OF_RANGE" and err.value.metadata["field"] == "sampling.min_tokens"
