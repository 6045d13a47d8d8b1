"""Out-of-memory detection and the test-only fault hooks applied by the scheduler."""
from __future__ import annotations

import torch

from .api import FaultSpec

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
