"""Out-of-memory detection, and the policy: the batch cap it imposes on plans, halved on OOM and
doubled back after `backoff_steps` clean steps, plus the clean-up after an OOM."""
from __future__ import annotations

import gc
import logging

import torch

log = logging.getLogger(__name__)

_OOM_MARKERS = ("out of memory", "can't allocate memory", "failed to allocate", "cannot allocate memory")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or the RuntimeError the CPU allocator raises when malloc fails."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(m in str(exc).lower() for m in _OOM_MARKERS))


class OomPolicy:
    def __init__(self, max_batch_size: int, backoff_steps: int):
        self.max_batch_size = max_batch_size
        self.backoff_steps = backoff_steps
        self.cap = max_batch_size
        self._clean_steps = 0

    def on_oom(self, exc: BaseException, batch: int) -> None:
        self.cap = max(1, batch // 2)
        self._clean_steps = 0
        log.warning("out of memory at batch %d; batch cap now %d", batch, self.cap,
                    extra={"batch_size": batch, "batch_cap": self.cap, "error": str(exc)})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def on_step(self) -> None:
        """One step ran: after enough clean ones the cap doubles back towards the configured maximum."""
        if self.cap >= self.max_batch_size:
            return
        self._clean_steps += 1
        if self._clean_steps >= self.backoff_steps:
            self.cap = min(self.max_batch_size, self.cap * 2)
            self._clean_steps = 0
