"""keel::row_stats (kernels/rowstats.cpp), the sampler's per-row statistics: close to a float64 torch
reference, the lowest id on ties, -inf scores and logits handled, and bitwise the same alone and in any
batch, at any thread count and on every SIMD path; malformed calls raise, naming the op."""
from __future__ import annotations

import math

import pytest
import torch

from services.inference.model import kernels

NINF = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def isas():
    return kernels.load().isas


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def stats(logits, scores=None, tokens=None, isa=-1):
    tokens = torch.full((logits.shape[0],), -1, dtype=torch.int64) if tokens is None else torch.tensor(tokens)
    return torch.ops.keel.row_stats(logits, logits if scores is None else scores, tokens, isa)


def reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax, entropy) in float64."""
    logp = torch.log_softmax(logits.double(), -1)
    return logp, -(logp.exp() * logp).nan_to_num().sum(-1)  # a -inf logit's term: 0 * -inf -> 0


def rows(r: int, v: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("v", [151936, 49152, 1037, 16, 5, 1])
@pytest.mark.parametrize("scale", [0.01, 4.0, 40.0])
def test_stats_track_the_float64_softmax(v, scale):
    x = rows(3, v, v, scale)
    argmax, got = stats(x, tokens=[-1, v // 2, v - 1])
    logp, entropy = reference(x)
    assert argmax.tolist() == x.argmax(-1).tolist()
    assert got[:, 0].tolist() == x.max(-1).values.double().tolist()
    assert got[:, 1].tolist() == pytest.approx(torch.exp(x.double() - x.double().max(-1, keepdim=True).values)
                                               .sum(-1).tolist(), rel=1e-6)
    assert got[:, 2].tolist() == pytest.approx(entropy.tolist(), rel=1e-6, abs=1e-6)
    want = [logp[0, argmax[0]], logp[1, v // 2], logp[2, v - 1]]
    assert got[:, 3].tolist() == pytest.approx([float(w) for w in want], rel=1e-6, abs=1e-6)


def test_argmax_takes_the_lowest_id_among_ties_within_and_across_lanes():
    x = torch.zeros(4, 100)
    x[0, [70, 7, 38]] = 5.0          # lanes 6, 7, 6: the first of lane 6 (38) is not the lowest id overall
    x[1, [17, 33, 1]] = 5.0          # one lane (1): its first occurrence
    x[2, 99] = x[2, 98] = 5.0        # the scalar tail
    argmax, got = stats(x)
    assert argmax.tolist() == [7, 1, 98, 0]  # row 3: all equal, id 0
    assert got[3, 2].item() == pytest.approx(math.log(100))  # uniform: log V


def test_scores_choose_the_token_and_the_logits_give_its_logprob():
    x = rows(2, 49152, 1)
    scores = x.clone()
    scores[:, : 40000] = NINF         # a grammar's mask
    scores[1, :] = NINF
    scores[1, 12345] = 0.0
    argmax, got = stats(x, scores)
    logp, entropy = reference(x)
    assert argmax.tolist() == [int(scores[0].argmax()), 12345]
    assert got[:, 3].tolist() == pytest.approx([float(logp[0, argmax[0]]), float(logp[1, 12345])], rel=1e-6)
    assert got[:, 2].tolist() == pytest.approx(entropy.tolist(), rel=1e-6)  # the logits', not the scores'


def test_minus_infinite_logits_count_for_nothing():
    x = rows(1, 1000, 2)
    x[0, ::3] = NINF
    argmax, got = stats(x, tokens=[3])
    logp, entropy = reference(x)
    assert math.isfinite(got[0, 2].item()) and got[0, 2].item() == pytest.approx(entropy.item(), rel=1e-6)
    assert got[0, 3].item() == NINF
    finite = x[x > NINF][None]  # the same distribution without them
    assert stats(finite)[1][0, 2].item() == pytest.approx(got[0, 2].item(), rel=1e-6)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_rows_stats_are_bitwise_the_same_alone_and_in_any_batch(threads, n_threads):
    x = rows(7, 151936, 3)
    threads(n_threads)
    batch = stats(x, tokens=[-1, 5, -1, 9, -1, -1, 151935])
    threads(1)
    for r, token in enumerate([-1, 5, -1, 9, -1, -1, 151935]):
        alone = stats(x[r:r + 1].clone(), tokens=[token])
        assert torch.equal(alone[0], batch[0][r:r + 1]) and torch.equal(alone[1], batch[1][r:r + 1]), r


def test_every_path_gives_the_portable_bits(isas):
    for v in (151936, 1037, 7):
        x = rows(3, v, v)
        scores = x.clone()
        scores[1, ::2] = NINF
        want = stats(x, scores, [-1, -1, v - 1], isa=0)
        for isa in isas:
            got = stats(x, scores, [-1, -1, v - 1], isa=kernels.ISAS.index(isa))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (isa, v)


def test_rows_may_be_views_with_a_row_stride():
    wide = rows(3, 2 * 1000, 4)
    x = wide[:, :1000]
    assert all(torch.equal(a, b) for a, b in zip(stats(x), stats(x.contiguous())))


@pytest.mark.parametrize("call, message", [
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8),
                                      torch.tensor([-1, -1]), -1), "logits must be a float32"),
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 8), torch.zeros(2, 9), torch.tensor([-1, -1]), -1), "differ"),
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 8), torch.zeros(2, 8), torch.tensor([-1]), -1), "tokens"),
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 8), torch.zeros(2, 8), torch.tensor([-1, 8]), -1), "outside"),
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 0), torch.zeros(2, 0), torch.tensor([-1, -1]), -1), "V = 0"),
    (lambda: torch.ops.keel.row_stats(torch.zeros(2, 8), torch.zeros(2, 8), torch.tensor([-1, -1]), 7), "isa"),
])
def test_malformed_calls_raise_naming_the_op(isas, call, message):
    with pytest.raises(RuntimeError, match=message) as info:
        call()
    assert "keel::row_stats" in str(info.value)


def test_rows_finite_flags_each_row_with_a_nan_or_an_infinity_anywhere():
    x = rows(8, 1037, 5, 1e30)  # large finite values: no overflow to inf
    for r, (j, bad) in enumerate([(0, NINF), (15, float("inf")), (1030, float("nan")), (1036, NINF), (500, 3e38)]):
        x[r, j] = bad
    x[5, 7] = 1e38
    wide = torch.full((2, 2074), float("nan"))
    wide[:, :1037] = x[4:6]  # finite row views whose stride passes over NaNs
    assert torch.ops.keel.rows_finite(x).tolist() == [False, False, False, False, True, True, True, True]
    assert torch.ops.keel.rows_finite(wide[:, :1037]).tolist() == [True, True]
    assert torch.ops.keel.rows_finite(torch.zeros(3, 0)).tolist() == [True] * 3
