"""Execution: runs one batch of a StepPlan on the model and returns its logits (no bookkeeping, no sampling)."""
from __future__ import annotations

import torch

from services.inference.engine.schedule import Batch
from services.inference.model.forward import LlamaRunner, RowCache, Segment


class BatchExecutor:
    """Runs a step's batches, each on the LlamaRunner of its weight format (one per format the variants
    and the breaker use)."""

    def __init__(self, runners: dict[str, LlamaRunner]):
        self.runners = runners

    def new_cache(self, runner: str, positions: int) -> RowCache:
        return self.runners[runner].new_cache(positions)

    def execute(self, batch: Batch) -> torch.Tensor:
        """Each row appends its tokens (prompt or last token) to its cache; float32 logits [rows, V].

        Cache lengths advance only when the whole batch succeeded, so a failed batch can be retried as is.
        """
        return self.runners[batch.runner].forward([Segment(w.row.cache, list(w.tokens), w.row.ticket.slot)
                                                   for w in batch.work])
