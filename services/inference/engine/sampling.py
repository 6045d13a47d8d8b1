"""Pick each row's next token: greedy or seeded sampling, with logprob and predictive entropy.

Sampling carries no random state between steps: the draw for the token at absolute position `position`
of a request seeded `seed` is a pure function of (seed, position) and the logits. A counter-based hash
(splitmix64 of the seed, the position and the vocabulary index) gives each candidate token a uniform
number, turned into Gumbel noise; the token is the argmax of scaled logits + noise (the Gumbel-max
trick, which draws exactly from softmax(logits / temperature)). Any step can therefore be recomputed
alone, in any batch, in any order, and gives the same token.

The maths of the draw is float64 and starts from logits minus their maximum, so the scaled logits are
<= 0 and finite or -inf for every positive temperature, however small (a temperature of 1e-45 is
greedy, not a NaN). logprob and entropy describe the model's distribution (float32 softmax of the
logits after any breaker clamp, before temperature/top-k/top-p), so they stay comparable across
sampling settings.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.inference.model import kernels

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True)
class Draw:
    """How one row draws its next token; `position` is the absolute position of the token being
    drawn (prompt length + its completion index)."""

    temperature: float  # 0: greedy (lowest id on ties)
    top_p: float
    top_k: int
    seed: int
    position: int


@dataclass(frozen=True)
class Pick:
    token_id: int
    logprob: float
    entropy: float


def row_is_finite(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] bool: True where every logit of the row is finite. CPU float32 rows: keel::rows_finite
    (one pass, one thread per row); otherwise the largest magnitude is below inf exactly then (amax
    propagates NaN, and NaN < inf is False: one vectorised reduction instead of a boolean tensor and its
    reduction)."""
    if _have_kernels() and _kernel_rows(logits):
        return torch.ops.keel.rows_finite(logits)
    return logits.abs().amax(dim=-1) < float("inf")


def clamp_logits(logits: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """The breaker's clamp of the logits to [-clamp, clamp] (None: unchanged)."""
    return logits if clamp is None else logits.clamp(-clamp, clamp)


def pick(logits: torch.Tensor, draws: Sequence[Draw], scores: torch.Tensor | None = None) -> list[Pick]:
    """Choose each row's token from finite float32 logits [R, V] (already clamped).

    `scores` [R, V] (the rows' generation controls applied to the logits: penalties, the grammar's
    mask; some may be -inf, never all of a row) are what the tokens are drawn from; None: the
    logits. logprob and entropy stay those of the model's distribution. Every operation works
    per row (element-wise, or per-row kernels along V; each row's entropy is summed alone), so a
    row's pick never depends on the other rows.

    On CPU float32 rows the greedy argmax, the logprob and the entropy come from one call of
    keel::row_stats (kernels/rowstats.cpp: two passes over each row, its own fixed order and exp, the
    same bits on every SIMD path); elsewhere (another device or dtype, or a host where Keel's kernels
    cannot be built) from torch's log_softmax (`_torch_stats`): their bits differ in the last places,
    and the kernel's identity is among the engine's serving facts (warmcache.serving_facts).
    """
    scores = logits if scores is None else scores
    drawn = [-1 if d.temperature <= 0.0 else _sample(scores[r], d.temperature, d.top_p, d.top_k, d.seed, d.position)
             for r, d in enumerate(draws)]
    if _have_kernels() and _kernel_rows(logits) and _kernel_rows(scores):
        greedy, stats = torch.ops.keel.row_stats(logits, scores, torch.tensor(drawn, dtype=torch.int64), -1)
        tokens = [g if t < 0 else t for t, g in zip(drawn, greedy.tolist())]
        entropy, chosen = stats[:, 2].tolist(), stats[:, 3].tolist()
    else:
        tokens, chosen, entropy = _torch_stats(logits, scores, drawn)
    return [Pick(t, lp, max(0.0, h)) for t, lp, h in zip(tokens, chosen, entropy)]


def _kernel_rows(x: torch.Tensor) -> bool:
    """Whether Keel's row ops read `x`: CPU float32 [R, V] with contiguous rows."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1


@functools.cache
def _have_kernels() -> bool:
    """Whether Keel's kernels (keel::row_stats, keel::rows_finite) load here (not: KernelUnavailable)."""
    try:
        kernels.load()
    except kernels.KernelUnavailable:
        return False
    return True


def _torch_stats(logits: torch.Tensor, scores: torch.Tensor, drawn: list[int]) -> tuple[list[int], list[float],
                                                                                         list[float]]:
    """(tokens, logprobs, entropies) of pick's rows by torch ops: `drawn` -1 takes the row's score argmax."""
    logp = torch.log_softmax(logits, dim=-1)
    plogp = -(logp.exp() * logp)
    greedy = scores.argmax(dim=-1).tolist() if -1 in drawn else []
    tokens = [greedy[r] if t < 0 else t for r, t in enumerate(drawn)]
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    return tokens, chosen, _row_sums(plogp).tolist()


def _row_sums(x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """[R, V] -> [R]: each row's sum in an order fixed by V alone. torch splits one reduction longer
    than its grain (32768 elements) across threads, so a plain sum of a vocabulary-long row has bits
    that depend on the thread count; here one thread sums each `chunk`-element piece, and then each
    row's V / chunk partial sums (a reduction short enough never to be split)."""
    rows, v = x.shape
    if v % chunk:
        x = torch.nn.functional.pad(x, (0, -v % chunk))  # zeros: exact terms at the end
    return x.reshape(rows, -1, chunk).sum(-1).sum(-1)


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int, position: int) -> int:
    wide = logits.double()
    scaled = (wide - wide.max()) / temperature  # <= 0; the top token is exactly 0
    candidates = _candidates(scaled, top_p, top_k)
    noise = torch.from_numpy(gumbel(seed, position, candidates.cpu().numpy())).to(scaled.device)
    return int(candidates[int(torch.argmax(scaled[candidates] + noise))])


def _candidates(scaled: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Vocabulary indices kept by top-k then top-p (always at least the top token), as int64 [C]."""
    if top_p >= 1.0 and not 0 < top_k < scaled.numel():
        return torch.arange(scaled.numel(), device=scaled.device)
    values, order = torch.sort(scaled, descending=True, stable=True)
    if 0 < top_k < values.numel():
        values, order = values[:top_k], order[:top_k]
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p.
        cumulative = torch.cumsum(torch.softmax(values, dim=-1), dim=-1)
        keep = int(torch.searchsorted(cumulative, torch.tensor(top_p, dtype=cumulative.dtype,
                                                               device=cumulative.device))) + 1
        order = order[:min(keep, order.numel())]
    return order


def gumbel(seed: int, position: int, indices: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise [len(indices)] float64 for (seed, position, vocabulary index): pure, stateless."""
    with np.errstate(over="ignore"):
        stream = _splitmix(np.array([seed], dtype=np.uint64) + _GOLDEN * np.array([position + 1], dtype=np.uint64))
        bits = _splitmix(stream + _GOLDEN * (indices.astype(np.uint64) + np.uint64(1)))
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53  # strictly inside (0, 1)
    return -np.log(-np.log(uniform))


def _splitmix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def clamp_temperature(temperature: float, cap: float | None) -> float:
    return temperature if cap is None else min(temperature, cap)
