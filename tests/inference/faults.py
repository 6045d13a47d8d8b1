"""Fault injection for the engine's tests: per-request faults applied around the batch executor.

Production never loads this module. `inject(engine)` wraps a warmed engine's batch executor with
`FaultInjectingExecutor` and returns its table (request id -> FaultSpec): each row gets the faults
of its request id; the step loop and the forward pass know nothing of faults.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from services.inference.engine.executor import StepOutput


@dataclass(frozen=True)
class FaultSpec:
    """Faults for one request. Step k is the forward pass that produces completion token k (step 0
    is the prefill). None or a negative step means never."""

    nan_at_step: int | None = None   # this row's hidden state becomes NaN at that step
    oom_at_step: int | None = None   # the step containing this row raises torch.OutOfMemoryError
    oom_repeat: bool = False         # keep raising at every later step too (not just once)
    slow_step_ms: int = 0            # sleep this long before every step of this request


class RowFaults:
    """Per-row view of a FaultSpec; tracks whether a one-shot OOM already fired."""

    def __init__(self, spec: FaultSpec | None):
        self.spec = spec or FaultSpec()
        self._oom_fired = False

    def nan_at(self, step: int) -> bool:
        return self.spec.nan_at_step == step

    @property
    def slow_s(self) -> float:
        return self.spec.slow_step_ms / 1000

    def take_oom(self, step: int) -> bool:
        """True when this step must raise; one-shot faults fire once, `oom_repeat` ones from then on."""
        at = self.spec.oom_at_step
        if at is None or at < 0 or step < at or (self._oom_fired and not self.spec.oom_repeat):
            return False
        if step > at and not self.spec.oom_repeat:
            return False
        self._oom_fired = True
        return True


def injected_oom(request_id: str, step: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"injected out of memory (request {request_id}, step {step})")


class FaultInjectingExecutor:
    """Applies each row's FaultSpec around `BatchExecutor.execute` (slow steps, OOM, NaN hidden state)."""

    def __init__(self, inner, faults: dict[str, FaultSpec]):
        self.inner = inner
        self.runners = inner.runners
        self.faults = faults
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Row -> RowFaults, while it runs

    def _of(self, row) -> RowFaults:
        if row not in self._rows:  # a row's faults are those of its request id when it first runs
            self._rows[row] = RowFaults(self.faults.get(row.ticket.req.request_id))
        return self._rows[row]

    def new_cache(self, runner: str, positions: int):
        return self.inner.new_cache(runner, positions)

    def execute(self, batch) -> StepOutput:
        rows = batch.rows
        delay = max(self._of(r).slow_s for r in rows)
        if delay:
            time.sleep(delay)
        for r in rows:
            if self._of(r).take_oom(r.step):
                raise injected_oom(r.ticket.req.request_id, r.step)
        spans, offset = [], 0
        for w in batch.work:
            n = len(w.tokens)
            if self._of(w.row).nan_at(w.row.step):
                spans.append((offset, offset + n))
            offset += n
        if not spans:
            return self.inner.execute(batch)

        def poison(_module, _args, out: torch.Tensor) -> torch.Tensor:
            # The embeddings of the poisoned rows' tokens become NaN: their whole hidden state follows.
            out = out.clone()
            for a, b in spans:
                out[a:b] = float("nan")
            return out

        embed = self.runners[batch.runner].model.model.embed_tokens
        handle = embed.register_forward_hook(poison)
        try:
            return self.inner.execute(batch)
        finally:
            handle.remove()


def inject(engine) -> dict[str, FaultSpec]:
    """Wrap a warmed engine's batch executor; returns the table (request id -> FaultSpec) it reads,
    for the test to fill before it submits those requests."""
    faults: dict[str, FaultSpec] = {}
    engine._loop.executor = FaultInjectingExecutor(engine._loop.executor, faults)
    return faults
