"""Out-of-memory detection, and fault injection as a wrapper around the model runner.

`FaultInjectingRunner` is installed in place of the plain runner only when
EngineConfig.fault_injection_enabled; the step loop and the forward pass know nothing of faults.
"""
from __future__ import annotations

import time

import torch

from services.inference.engine.api import FaultSpec

_OOM_MARKERS = ("out of memory", "can't allocate memory", "failed to allocate", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or the RuntimeError the CPU allocator raises when malloc fails."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(m in str(exc).lower() for m in _OOM_MARKERS))


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


class FaultInjectingRunner:
    """Applies each row's FaultSpec around `ModelRunner.execute` (slow steps, OOM, NaN hidden state)."""

    def __init__(self, inner):
        self.inner = inner
        self.runners = inner.runners

    def new_cache(self, runner: str, positions: int):
        return self.inner.new_cache(runner, positions)

    def execute(self, batch) -> torch.Tensor:
        rows = batch.rows
        delay = max(r.faults.slow_s for r in rows)
        if delay:
            time.sleep(delay)
        for r in rows:
            if r.faults.take_oom(r.step):
                raise injected_oom(r.ticket.req.request_id, r.step)
        spans, offset = [], 0
        for r in rows:
            n = len(r.tokens)
            if r.faults.nan_at(r.step):
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
