"""Execution: runs one batch of a StepPlan on the model and returns its logits and prompt scores (no bookkeeping,
no sampling)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.inference.engine.schedule import Batch
from services.inference.model.forward import LlamaRunner, RowCache, Segment
from services.inference.model.scoring import PromptScores
from shared.controls import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class StepOutput:
    """What one batch's step computed: float32 logits [rows, V] of each row's last token; and when a
    row of the batch scores its prompt (Row.scores_prompt), each row's scores of its prompt chunk
    (None for the others, and for a last chunk of one token: nothing to score), else ()."""

    logits: torch.Tensor
    prompt_scores: tuple[PromptScores | None, ...] = ()


class BatchExecutor:
    """Runs a step's batches, each on the LlamaRunner of its weight format (one per format the variants
    and the breaker use)."""

    def __init__(self, runners: dict[str, LlamaRunner]):
        self.runners = runners

    def new_cache(self, runner: str, positions: int) -> RowCache:
        return self.runners[runner].new_cache(positions)

    def execute(self, batch: Batch) -> StepOutput:
        """Each row appends its tokens (prompt or last token) to its cache.

        Cache lengths advance only when the whole batch succeeded, so a failed batch can be retried as is.
        """
        runner = self.runners[batch.runner]
        segments = [Segment(w.row.cache, list(w.tokens), w.row.ticket.slot) for w in batch.work]
        scored = [(s, w) for s, w in zip(segments, batch.work) if w.prefill and w.row.scores_prompt]
        if not scored:
            return StepOutput(runner.forward(segments))
        for segment, w in scored:  # the prompt token after each of the chunk's
            segment.targets = w.row.ticket.req.prompt_ids[w.start + 1:w.start + len(w.tokens) + 1] or None
        # Every row gets the most alternatives a request may ask for (controls.py keeps its own).
        logits, scores = runner.forward_scoring(segments, MAX_TOP_LOGPROBS)
        return StepOutput(logits, tuple(scores))
