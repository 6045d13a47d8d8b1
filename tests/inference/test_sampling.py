"""Sampling maths, seeds and determinism, and the engine's drain on stop."""
from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from services.inference.engine.sampling import Draw, clamp_logits, gumbel, pick, row_is_finite
from shared.errors import NotReady
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, ids, prompt, request


def logits_fixture() -> torch.Tensor:
    return torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0])


def pick1(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, position: int):
    """One row's pick: logits [V]."""
    return pick(logits[None], [Draw(temperature, top_p, top_k, seed, position)])[0]


def test_greedy_takes_the_lowest_id_among_ties_and_reports_logprob_and_entropy():
    logits = logits_fixture()
    p = pick1(logits, 0.0, 1.0, 0, 0, 0)
    logp = torch.log_softmax(logits, -1)
    assert p.token_id == 1
    assert p.logprob == pytest.approx(float(logp[1]))
    assert p.entropy == pytest.approx(float(-(logp.exp() * logp).sum()))


def test_a_vocabulary_long_entropy_has_the_same_bits_at_any_thread_count_and_in_any_batch():
    """torch splits a reduction over more than 32768 elements across threads; the entropy of a
    49152-token row must not depend on how many there are, nor on the row's batch-mates."""
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)) * 4
    draws = [Draw(0.0, 1.0, 0, 0, 5)] * 3
    before = torch.get_num_threads()
    try:
        seen = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen.append([p.entropy for p in pick(logits, draws)])
            seen.append([pick(logits[r:r + 1], draws[:1])[0].entropy for r in range(3)])
    finally:
        torch.set_num_threads(before)
    assert all(s == seen[0] for s in seen), seen
    logp = torch.log_softmax(logits.double(), -1)
    assert seen[0] == pytest.approx((-(logp.exp() * logp).sum(-1)).tolist(), rel=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy():
    for pos in range(20):
        assert pick1(logits_fixture(), 1.0, 1.0, 1, 0, pos).token_id == 1
        assert pick1(logits_fixture(), 1.0, 1e-6, 0, 0, pos).token_id == 1


def test_top_k_restricts_the_support():
    seen = {pick1(logits_fixture(), 10.0, 1.0, 3, 1, pos).token_id for pos in range(300)}
    assert seen == {1, 2, 3}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities ~ [0.5, 0.3, 0.2]: top_p 0.75 keeps the first two only.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    seen = {pick1(logits, 1.0, 0.75, 0, 2, pos).token_id for pos in range(300)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution_across_positions_and_across_seeds():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    target = torch.tensor([0.7, 0.2, 0.1])
    by_position = torch.tensor([pick1(logits, 1.0, 1.0, 0, 3, pos).token_id for pos in range(3000)])
    by_seed = torch.tensor([pick1(logits, 1.0, 1.0, 0, seed, 7).token_id for seed in range(3000)])
    for draws in (by_position, by_seed):
        assert (torch.bincount(draws, minlength=3).float() / 3000 - target).abs().max() < 0.04


def test_temperature_scales_the_distribution():
    logits = torch.log(torch.tensor([0.6, 0.4]))
    hot = sum(pick1(logits, 50.0, 1.0, 0, 4, pos).token_id for pos in range(2000)) / 2000
    cold = sum(pick1(logits, 0.05, 1.0, 0, 4, pos).token_id for pos in range(2000)) / 2000
    assert abs(hot - 0.5) < 0.04 and cold < 0.01


def test_a_draw_is_a_pure_function_of_seed_position_and_logits():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0))
    forward = [pick1(logits, 1.0, 0.95, 50, 99, pos).token_id for pos in range(64)]
    backward = [pick1(logits, 1.0, 0.95, 50, 99, pos).token_id for pos in reversed(range(64))][::-1]
    assert forward == backward                                     # no state carried from one draw to the next
    assert pick1(logits, 1.0, 0.95, 50, 99, 40).token_id == forward[40]  # one step recomputed alone
    assert len(set(forward)) > 5                                    # and the draws do vary with the position
    assert forward != [pick1(logits, 1.0, 0.95, 50, 100, pos).token_id for pos in range(64)]


def test_gumbel_noise_is_pure_and_distinct_per_index():
    idx = np.arange(1000)
    a = gumbel(5, 11, idx)
    assert np.array_equal(a, gumbel(5, 11, idx)) and np.array_equal(a[[7, 3]], gumbel(5, 11, np.array([7, 3])))
    assert np.isfinite(a).all() and len(set(a.tolist())) == 1000
    assert abs(a.mean() - 0.5772) < 0.1                            # the Gumbel mean (Euler's constant)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-300, 1e300, 1.7e308])
@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (5e-324, 0), (0.9, 2**31), (1.0, 1)])
def test_extreme_valid_parameters_always_give_a_token(temperature, top_p, top_k):
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0, -80.0])
    p = pick1(logits, temperature, top_p, top_k, 2**63 - 1, 2**31)
    assert 0 <= p.token_id < 6 and math.isfinite(p.logprob)
    if temperature < 1e-40 or top_k == 1 or top_p < 1e-300:
        assert p.token_id in (1, 3)                                # a vanishing temperature is greedy


def test_clamp_applies_to_reported_logprob():
    logits = torch.tensor([100.0, 0.0])
    assert pick1(clamp_logits(logits, 1.0), 0.0, 1.0, 0, 0, 0).logprob == pytest.approx(-math.log1p(math.exp(-1)))


def test_row_is_finite_flags_only_the_bad_rows():
    x = torch.zeros(5, 4)
    x[1, 2] = float("nan")
    x[2, 0] = float("-inf")
    x[3, 3] = float("inf")
    x[4] = torch.tensor([3e38, -3e38, 0.0, 1.0])  # large but finite
    assert row_is_finite(x).tolist() == [True, False, False, False, True]
    wide = torch.randn(4, 49152 + 7)  # the vectorised reduction and its tail
    wide[1, -1], wide[2, 5], wide[3, 20000] = float("nan"), float("nan"), float("inf")
    assert row_is_finite(wide).tolist() == [True, False, False, False]


@pytest.mark.slow
@pytest.mark.asyncio
async def test_same_seeded_request_ten_times_is_identical(make_engine):
    engine = await make_engine()
    runs = [await collect(engine, request(f"s{i}", prompt(1), max_tokens=16, temperature=0.9, top_p=0.95,
                                          top_k=50, seed=1234)) for i in range(10)]
    first = runs[0][0]
    for tokens, fin in runs:
        assert ids(tokens) == ids(first) and fin.seed == 1234
        assert max(abs(a.logprob - b.logprob) for a, b in zip(tokens, first)) <= 1e-5
    other, _ = await collect(engine, request("o", prompt(1), max_tokens=16, temperature=0.9, top_p=0.95,
                                             top_k=50, seed=1235))
    assert ids(other) != ids(first)


@pytest.mark.asyncio
async def test_chosen_seed_is_echoed_and_replays(make_engine):
    engine = await make_engine()
    tokens, fin = await collect(engine, request("a", prompt(2), max_tokens=12, temperature=1.0))
    again, fin2 = await collect(engine, request("b", prompt(2), max_tokens=12, temperature=1.0, seed=fin.seed))
    assert ids(again) == ids(tokens) and fin2.seed == fin.seed


@pytest.mark.asyncio
async def test_seeded_sampling_is_batch_invariant(make_engine):
    engine = await make_engine()
    reqs = [request(f"r{i}", prompt(i), max_tokens=10, temperature=1.0, seed=i) for i in range(6)]
    alone = [await collect(engine, r) for r in reqs]
    together = await asyncio.gather(*(collect(engine, r) for r in reqs))
    assert [ids(a) for a, _ in alone] == [ids(b) for b, _ in together]


@pytest.mark.asyncio
async def test_stop_lets_in_flight_work_finish_within_grace(make_engine):
    engine = await make_engine()
    inject(engine)["a"] = FaultSpec(slow_step_ms=20)  # ~200 ms of work: still running when the late request arrives
    running = asyncio.create_task(collect(engine, request("a", prompt(1), max_tokens=10)))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(engine.stop(grace_s=30))
    await asyncio.sleep(0.01)
    with pytest.raises(NotReady) as e:
        await collect(engine, request("late", prompt(2)))
    assert e.value.reason == "DRAINING"
    tokens, fin = await running
    await stopping
    assert len(tokens) == 10 and engine.stats().state == "stopped"


@pytest.mark.asyncio
async def test_stop_fails_what_outlives_the_grace(make_engine):
    engine = await make_engine()
    stream = engine.generate(request("a", prompt(1), max_tokens=3000))
    await stream.__anext__()
    await engine.stop(grace_s=0.02)
    with pytest.raises(NotReady) as e:
        async for _ in stream:
            pass
    assert e.value.reason == "SHUTTING_DOWN"


@pytest.mark.asyncio
async def test_any_step_recomputed_alone_from_its_prefix_draws_the_same_token(make_engine):
    """The draw depends only on (seed, position) and the logits: resuming a request from any point,
    with its own tokens as the prompt and the same seed, continues it exactly."""
    engine = await make_engine()
    base = prompt(4)
    tokens, _ = await collect(engine, request("full", base, max_tokens=12, temperature=1.0, top_p=0.95, seed=77))
    for k in (1, 5, 11):
        resumed, _ = await collect(engine, request(f"k{k}", base + ids(tokens[:k]), max_tokens=1, temperature=1.0,
                                                   top_p=0.95, seed=77))
        assert ids(resumed) == [tokens[k].token_id]


def test_the_kernel_and_torch_paths_pick_alike():
    """float32 CPU rows go to keel::row_stats, others (here float64) to torch's log_softmax: the same
    tokens, logprobs and entropies to float32 precision."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(1)) * 4
    scores = logits.clone()
    scores[2, :30000] = float("-inf")
    draws = [Draw(0.0, 1.0, 0, 0, 5), Draw(0.8, 0.9, 40, 3, 5), Draw(0.0, 1.0, 0, 0, 5), Draw(1.0, 1.0, 0, 9, 7)]
    fused, torch_path = pick(logits, draws, scores), pick(logits.double(), draws, scores.double())
    assert [p.token_id for p in fused] == [p.token_id for p in torch_path]
    assert [p.logprob for p in fused] == pytest.approx([p.logprob for p in torch_path], rel=1e-5)
    assert [p.entropy for p in fused] == pytest.approx([p.entropy for p in torch_path], rel=1e-5)
