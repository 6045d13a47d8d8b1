"""Prompt scoring: how likely the model found each prompt token, from a prefill chunk's hidden states.

The hidden state at prompt position p gives the model's distribution of the token at p + 1. For a
chunk at positions st..st+n-1 the runner (forward.py) hands the final hidden states of its rows and
the prompt tokens that follow them (`targets`, one fewer than the rows when the chunk ends the prompt:
the last position predicts the answer's first token, not a prompt token), and gets per row the
log-probability of its target under log_softmax of the logits, and the `top` most likely tokens.

Batch invariance: the rows go through the final norm and lm_head in groups of at most the runner's
largest invariant batch size, each padded to an invariant size (`LlamaRunner.padded_size`), exactly as
the last rows of a step are: a position's logits are then bitwise those the runner gives when that
position is the last of a prefill, whatever the chunk and the batch around it. Each group is reduced to
(logprob, top-k) at once, so logits [P, V] of a long prompt are never held whole, only [group, V].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # forward.py imports this module
    from services.inference.model.forward import LlamaRunner

GROUP_ROWS = 16  # rows per lm_head call when the runner calibrated no invariant sizes


@dataclass(frozen=True)
class PromptScores:
    """A chunk's scored positions, in order: logprobs [n] of their targets; the most likely tokens,
    top_ids [n, top] (int64) and their top_logprobs [n, top], most likely first (ties in the order
    torch.topk gives them)."""

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor


def score_rows(runner: LlamaRunner, h: torch.Tensor, targets: list[int], top: int) -> PromptScores:
    """Score the hidden states h [n, hidden] of n consecutive prompt positions against `targets` [n]."""
    n, width = h.shape
    head, norm = runner.model.lm_head, runner.model.model.norm
    group = max(runner.invariant_sizes, default=GROUP_ROWS)
    index = torch.tensor(targets, dtype=torch.long, device=h.device)
    logprobs, values, ids = [], [], []
    for a in range(0, n, group):
        m = min(group, n - a)
        rows = torch.zeros(runner.padded_size(m), width, dtype=h.dtype, device=h.device)
        rows[:m] = h[a:a + m]
        dist = torch.log_softmax(head(norm(rows)).float()[:m], dim=-1)  # [m, V]
        logprobs.append(dist.gather(1, index[a:a + m, None])[:, 0])
        v, i = torch.topk(dist, min(top, dist.shape[-1]), dim=-1)
        values.append(v)
        ids.append(i)
    return PromptScores(torch.cat(logprobs), torch.cat(values), torch.cat(ids))
