"""Prompt logprobs (controls.prompt_logprobs): every prompt token's log-probability under the model
given the tokens before it, computed in the prefill (model/scoring.py), on the tiny model over the
real vocabulary."""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from prometheus_client import CollectorRegistry

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2
from services.inference.engine.controls import TokenLogprobs
from services.inference.engine.grammar import Vocabulary
from services.inference.engine.memory import PeakMeter
from services.inference.model.forward import LlamaRunner, Segment
from services.inference.servicer import InferenceServicer
from shared.controls import Controls
from shared.metrics import metrics_for
from shared.modelfile import source as model_source
from tests.inference.helpers import collect, prompt, request

EOS = (2,)
CHUNK = 32
PROMPT = prompt(3, 2 * CHUNK + 11)  # three prefill chunks, the last one partial


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(model_source().cache_dir / "hf-tokenizer" / "tokenizer.json", EOS)


@pytest_asyncio.fixture
async def chunked(make_engine, vocab, tiny):
    """Prefills CHUNK tokens per step and keeps a prefix cache of 8 prompt blocks."""
    block_bytes = LlamaRunner(tiny).kv_bytes_per_token * CHUNK
    e = await make_engine(eos_token_ids=EOS, prefill_tokens_per_iteration=CHUNK, prefix_cache_bytes=8 * block_bytes)
    e.install_vocabulary(vocab)
    return e


async def scores(engine, rid: str, ids: list[int], k: int = 3, **kw) -> tuple[TokenLogprobs, ...]:
    _, fin = await collect(engine, request(rid, ids, max_tokens=3, controls=Controls(prompt_logprobs=k), **kw))
    return fin.prompt_logprobs


@pytest.mark.asyncio
async def test_each_prompt_token_gets_its_logprob_under_the_models_raw_distribution(chunked, tiny, vocab):
    got = await scores(chunked, "scored", PROMPT)
    with torch.inference_mode():  # the model's own full-sequence forward, independent of the runner
        dist = torch.log_softmax(tiny(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [P, V]
    assert len(got) == len(PROMPT)
    assert got[0] == TokenLogprobs(PROMPT[0], vocab.text(PROMPT[0]), 0.0, ())  # nothing precedes it
    for p in range(1, len(PROMPT)):
        e = got[p]
        assert (e.token_id, e.token) == (PROMPT[p], vocab.text(PROMPT[p]))
        assert e.logprob == pytest.approx(dist[p - 1, PROMPT[p]].item(), abs=1e-4)
        best = torch.topk(dist[p - 1], 3)
        assert [a.token_id for a in e.top] == best.indices.tolist()
        assert [a.token for a in e.top] == [vocab.text(i) for i in best.indices.tolist()]
        assert [a.logprob for a in e.top] == pytest.approx(best.values.tolist(), abs=1e-4)
    # raw: neither temperature nor penalties change them
    shaped = await collect(chunked, request("shaped", PROMPT, max_tokens=3, temperature=0.7, seed=5, controls=Controls(
        prompt_logprobs=3, repetition_penalty=1.5, frequency_penalty=1.0)))
    assert shaped[1].prompt_logprobs == got


@pytest.mark.asyncio
async def test_the_alternatives_are_as_many_as_asked_most_likely_first(chunked):
    for k in (0, 1, 5):
        got = await scores(chunked, f"k{k}", PROMPT, k=k)
        assert got[0].top == () and all(len(e.top) == k for e in got[1:])
        for e in got[1:]:
            values = [a.logprob for a in e.top]
            assert values == sorted(values, reverse=True) and (not values or values[0] >= e.logprob)
    one = await scores(chunked, "one", PROMPT[:1])
    assert [(e.token_id, e.logprob, e.top) for e in one] == [(PROMPT[0], 0.0, ())]


@pytest.mark.asyncio
async def test_scores_are_bitwise_the_same_alone_beside_other_rows_and_after_a_prefix_hit(chunked):
    alone = await scores(chunked, "alone", PROMPT)
    stats = chunked.stats().prefix_cache
    assert (stats.prompt_tokens, stats.hit_tokens) == (0, 0)  # a scored prompt is not looked up
    await collect(chunked, request("plain", PROMPT, max_tokens=2))  # a plain request still hits
    assert chunked.stats().prefix_cache.hit_tokens == 2 * CHUNK
    busy = asyncio.create_task(collect(chunked, request("busy", prompt(9, 40), max_tokens=60)))
    results = await asyncio.gather(scores(chunked, "again", PROMPT), scores(chunked, "other", prompt(4, 90)),
                                   collect(chunked, request("short", prompt(5, 7), max_tokens=20)))
    await busy
    assert results[0] == alone                                     # batched, after its blocks were cached
    assert chunked.stats().prefix_cache.hit_tokens == 2 * CHUNK    # the scored ones took no hit


@pytest.mark.asyncio
async def test_chunked_scores_match_whole_prompt_scores(chunked, make_engine, vocab):
    whole = await make_engine(eos_token_ids=EOS)
    whole.install_vocabulary(vocab)
    a, b = await scores(chunked, "chunked", PROMPT), await scores(whole, "whole", PROMPT)
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
    assert [[t.token_id for t in e.top] for e in a] == [[t.token_id for t in e.top] for e in b]


@pytest.mark.asyncio
async def test_a_request_without_prompt_logprobs_is_unchanged(chunked):
    plain, fin = await collect(chunked, request("plain", PROMPT, max_tokens=6))
    scored, fin_scored = await collect(chunked, request("scored", PROMPT, max_tokens=6,
                                                        controls=Controls(prompt_logprobs=2)))
    assert fin.prompt_logprobs == () and len(fin_scored.prompt_logprobs) == len(PROMPT)
    assert [(t.token_id, t.logprob, t.entropy) for t in plain] == [(t.token_id, t.logprob, t.entropy) for t in scored]


def test_a_long_chunk_is_scored_in_invariant_groups_without_holding_its_logits_whole(tiny):
    runner = LlamaRunner(tiny)
    runner.calibrate_invariant_sizes(16)
    ids, after = prompt(4, 994), 77  # a chunk that is not the prompt's last: its last row is scored too
    plain = runner.forward([Segment(runner.new_cache(len(ids)), ids)])
    with PeakMeter() as meter:
        logits, [got] = runner.forward_scoring([Segment(runner.new_cache(len(ids)), ids, targets=ids[1:] + [after])],
                                               5)
    assert torch.equal(logits, plain)                        # the last token's logits are forward's
    assert got.logprobs.shape == (len(ids),) and got.top_ids.shape == (len(ids), 5)
    # the last row, scored in a group of 2 (padded as forward pads it), has the bits of the last row alone
    assert got.logprobs[-1].item() == torch.log_softmax(plain[0], dim=-1)[after].item()
    assert meter.peak < len(ids) * runner.vocab_size * 4 / 8  # [P, V] float32 would be 8x this


class _Context:
    def time_remaining(self):
        return None


@pytest.mark.asyncio
async def test_the_servicer_sends_the_prompt_logprobs_in_finished(chunked):
    servicer = InferenceServicer(chunked, metrics_for("inference", CollectorRegistry()))

    async def finished(**sampling) -> inference_pb2.Finished:
        req = inference_pb2.GenerateRequest(prompt_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=2,
                                                                                                  **sampling))
        return [ev async for ev in servicer.Generate(req, _Context())][-1].finished

    want = await scores(chunked, "engine", PROMPT, k=2)
    got = (await finished(prompt_logprobs=2)).prompt_logprobs
    assert [(e.token, e.token_id, e.logprob, [(a.token, a.token_id, a.logprob) for a in e.top_logprobs]) for e in got] \
        == [(e.token, e.token_id, e.logprob, [(a.token, a.token_id, a.logprob) for a in e.top]) for e in want]
    assert got[0].logprob == 0.0 and not got[0].top_logprobs
    assert len((await finished(prompt_logprobs=0)).prompt_logprobs) == len(PROMPT)  # set to 0: scored
    assert not (await finished()).prompt_logprobs                                   # unset: not scored
