"""Pick the next token of one row: greedy or seeded sampling, with logprob and predictive entropy.

All maths is float32 on the row's logits [V]. The logprob and entropy describe the model's distribution
(softmax of the logits after any breaker clamp, before temperature/top-k/top-p), so they stay comparable
across sampling settings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Pick:
    token_id: int
    logprob: float
    entropy: float


def row_is_finite(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] bool: True where every logit of the row is finite."""
    return torch.isfinite(logits).all(dim=-1)


def pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
         generator: torch.Generator | None, clamp: float | None = None) -> Pick:
    """Choose a token from finite float32 logits [V]; temperature 0 means greedy (lowest id on ties)."""
    if clamp is not None:
        logits = logits.clamp(-clamp, clamp)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = float(-(logp.exp() * logp).sum())
    if temperature <= 0.0:
        token = int(torch.argmax(logits))
    else:
        token = _sample(logits / temperature, top_p, top_k, generator)
    return Pick(token, float(logp[token]), max(0.0, entropy))


def _sample(scaled: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None) -> int:
    values, order = torch.sort(scaled, descending=True, stable=True)
    if 0 < top_k < values.numel():
        values, order = values[:top_k], order[:top_k]
    probs = torch.softmax(values, dim=-1)
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        cumulative = torch.cumsum(probs, dim=-1)
        keep = int(torch.searchsorted(cumulative, torch.tensor(top_p, device=cumulative.device))) + 1
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return int(order[choice])


def clamp_temperature(temperature: float, cap: float | None) -> float:
    return temperature if cap is None else min(temperature, cap)
