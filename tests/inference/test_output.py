"""A step's sampling over all its rows at once (shape, pick, logprobs on [R, V]): each row's result is
bit-identical to the row alone at any thread count, and a failure confined to one row fails only it."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

import services.inference.engine.sampling as sampling
from services.inference.engine.controls import RowControls, logprobs, shape
from services.inference.engine.grammar import Grammars, MaskExecutor, Vocabulary
from services.inference.engine.sampling import Draw, pick
from shared.controls import Controls, ResponseFormat
from shared.modelfile import source as model_source
from tests.inference.helpers import collect, ids, prompt, request
from tests.inference.schemas import SCHEMAS

EOS = (2,)


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(model_source().cache_dir / "hf-tokenizer" / "tokenizer.json", EOS)


def controls_of(i: int) -> Controls:
    kind = i % 5
    if kind == 0:
        return Controls()
    if kind == 1:
        return Controls(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4, logprobs=True,
                        top_logprobs=1 + i % 5)
    if kind == 2:
        return Controls(response_format=ResponseFormat("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])),
                        logprobs=True)
    if kind == 3:
        return Controls(response_format=ResponseFormat("regex", r"[a-z ]{1,12}\."), presence_penalty=1.5)
    return Controls(logprobs=True, top_logprobs=5)


async def rows_of(vocab: Vocabulary, n: int) -> list[RowControls | None]:
    grammars = Grammars(vocab)
    rows = []
    for i in range(n):
        c = controls_of(i)
        m = await grammars.matcher(c.response_format) if c.response_format else None
        rows.append(None if c == Controls() else RowControls(c, prompt(i, 4 + i % 7), vocab, m))
    grammars.close()
    return rows


def sample(rows, logits, draws, masks):
    shaped = shape(rows, logits, masks)
    picks = pick(logits, draws, shaped.scores)
    lps = logprobs(rows, shaped.scores, [p.token_id for p in picks], [d.temperature for d in draws])
    return shaped.scores, picks, lps


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("threads", [1, 2])
async def test_every_row_of_a_batched_step_equals_the_row_alone_bitwise(vocab, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, steps = 12, 5
        together, alone = await rows_of(vocab, n), await rows_of(vocab, n)
        masks = MaskExecutor(threads)
        gen = torch.Generator().manual_seed(threads)
        for step in range(steps):
            logits = torch.randn(n, vocab.size, generator=gen) * 4
            draws = [Draw((i % 3) * 0.6, 0.9 if i % 2 else 1.0, 40 * (i % 2), i, 20 + step) for i in range(n)]
            scores, picks, lps = sample(together, logits, draws, masks)
            assert scores is not logits and torch.isinf(scores).any()  # some rows are penalised and masked
            for i in range(n):
                s1, p1, lp1 = sample([alone[i]], logits[i:i + 1].clone(), [draws[i]], masks)
                assert torch.equal(scores[i], s1[0]) and picks[i] == p1[0] and lps[i] == lp1[0], (step, i)
                for rows in (together, alone):
                    if rows[i] is not None:
                        rows[i].accept(picks[i].token_id)
        assert all(lps[i] is not None and len(lps[i].top) == together[i].c.top_logprobs
                   for i in range(n) if together[i] is not None and together[i].c.logprobs)
    finally:
        torch.set_num_threads(before)


@pytest.mark.asyncio
async def test_a_row_whose_sampling_fails_fails_alone(make_engine, monkeypatch):
    engine = await make_engine()
    reqs = [request(f"s{i}", prompt(i), max_tokens=6, temperature=0.8, seed=i) for i in range(6)]
    alone = [await collect(engine, r) for r in reqs]
    real = sampling._sample

    def flaky(logits, temperature, top_p, top_k, seed, position):
        if seed == 3:
            raise RuntimeError("a defect in this row's draw")
        return real(logits, temperature, top_p, top_k, seed, position)

    monkeypatch.setattr(sampling, "_sample", flaky)
    results = await asyncio.gather(*(collect(engine, r) for r in reqs), return_exceptions=True)
    assert getattr(results[3], "reason", None) == "SAMPLING_FAILED"
    for i, (got, want) in enumerate(zip(results, alone)):
        if i != 3:
            assert ids(got[0]) == ids(want[0]) and got[1].finish_reason == "length"
