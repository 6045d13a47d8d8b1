"""A per-request CPU budget for the input check.

The check runs in a worker thread, so its cost is that thread's CPU time (``time.thread_time``:
neither waiting for the GIL nor other requests count against it). The check calls
:meth:`CpuBudget.charge` after each step (parsing, the contract, normalising, each rule); once
the budget is spent the next charge raises :class:`CpuBudgetExceeded` and the request is refused.
Every step is linear in the input (rules run on RE2), so the overshoot is at most one step.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class CpuBudgetExceeded(Exception):
    def __init__(self, step: str, spent_s: float, limit_s: float):
        super().__init__(f"checking this input used {spent_s * 1e3:.1f} ms of CPU by the end of "
                         f"{step}, over the budget of {limit_s * 1e3:g} ms")
        self.step = step


class CpuBudget:
    def __init__(self, limit_s: float | None, clock: Callable[[], float] = time.thread_time):
        self.limit_s, self._clock = limit_s, clock
        self._start = clock()

    def charge(self, step: str) -> None:
        """Raise CpuBudgetExceeded if the CPU time used since creation is over the limit."""
        if self.limit_s is None:
            return
        spent = self._clock() - self._start
        if spent > self.limit_s:
            raise CpuBudgetExceeded(step, spent, self.limit_s)
