"""A sampling parameter that is valid but numerically extreme never harms the other rows of its batch."""
from __future__ import annotations

import asyncio

import pytest

from tests.inference.helpers import collect, ids, prompt, request


@pytest.mark.asyncio
async def test_tiny_positive_temperature_neither_fails_its_row_nor_its_batch_mates(make_engine):
    engine = await make_engine()
    mates = [request(f"m{i}", prompt(i), max_tokens=6, temperature=0.8, seed=i) for i in range(3)]
    alone = [await collect(engine, r) for r in mates]
    greedy, _ = await collect(engine, request("g", prompt(9), max_tokens=6))
    tiny = request("t", prompt(9), max_tokens=6, temperature=1e-45, top_p=0.9, seed=5)
    together = await asyncio.gather(*(collect(engine, r) for r in [*mates, tiny]))
    assert [ids(t) for t, _ in together[:3]] == [ids(t) for t, _ in alone]
    tokens, fin = together[3]
    assert fin.finish_reason == "length" and ids(tokens) == ids(greedy)  # a vanishing temperature is greedy
