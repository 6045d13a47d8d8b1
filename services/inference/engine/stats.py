"""Typed, immutable snapshots of the engine's state, published by the step loop for gauges, spans and tests.

The loop thread owns every mutable counter; after each iteration it publishes a fresh `EngineStats`
(before it delivers that iteration's events, so a consumer that has seen a request finish also sees
the stats that count it). Readers on other threads only ever swap in a reference to a frozen object.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from services.inference.engine.breaker import BreakerState
from services.inference.engine.memory import MemoryModel
from services.inference.engine.prefix import PrefixStats


def _empty() -> Mapping:
    return MappingProxyType({})


class EngineState(StrEnum):
    """The engine's life: created -> warm (warmup) -> serving (start) -> draining (stop) -> stopped."""

    CREATED = "created"
    WARM = "warm"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class Counters:
    """Loop-owned running totals (mutable; never read outside the loop thread)."""

    admitted: int = 0
    completed: int = 0
    tokens: int = 0
    numerical_faults: int = 0
    oom_events: int = 0
    oom_recoveries: int = 0
    failed: dict[str, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1

    def snapshot(self) -> CounterStats:
        return CounterStats(self.admitted, self.completed, self.tokens, self.numerical_faults, self.oom_events,
                            self.oom_recoveries, MappingProxyType(dict(self.failed)))


@dataclass(frozen=True)
class CounterStats:
    admitted: int = 0
    completed: int = 0
    tokens: int = 0              # tokens streamed
    numerical_faults: int = 0
    oom_events: int = 0
    oom_recoveries: int = 0      # OOM steps retried in halves
    failed: Mapping[str, int] = field(default_factory=_empty)  # by error reason


@dataclass(frozen=True)
class Pace:
    """How fast one row decodes at the current batch: an EWMA of 1 / step time over the steps that
    decoded (each decoding row gets one token per step; a step that also prefills newcomers counts
    whole, so the rate errs slow), and how many steps it has seen."""

    row_tokens_per_s: float = 0.0
    steps: int = 0

    def after(self, step_s: float) -> Pace:
        """The pace once a decoding step of ``step_s`` seconds is counted (the first counts whole)."""
        rate = 1 / max(step_s, 1e-6)
        return Pace(rate if not self.steps else 0.8 * self.row_tokens_per_s + 0.2 * rate, self.steps + 1)


@dataclass(frozen=True)
class MemoryStats:
    model: MemoryModel | None = None  # the fitted memory model (coefficients)
    budget_bytes: int = 0
    predicted_bytes: int = 0          # static + reservations of admitted requests + prefix cache room
    observed_peak_bytes: int | None = None  # when EngineConfig.memory_audit is on

    @property
    def static_bytes(self) -> int:
        return self.model.static_bytes if self.model is not None else 0


@dataclass(frozen=True)
class EngineStats:
    state: EngineState = EngineState.CREATED
    queue_depth: int = 0
    queued_tokens: int = 0
    retry_after_ms: int = 0           # the hint a request refused now would get (Scheduler.retry_after_ms)
    running_batch_size: int = 0
    running_tokens: int = 0           # prompt + max_tokens of the running rows (queued_tokens' unit)
    free_kv_blocks: int = 0           # KV pool blocks no running row has reserved (prefix cache's room aside)
    pending_prefill: int = 0          # admitted, waiting for their prefill
    batch_cap: int = 0                # current cap (config, breaker level 2, OOM halving)
    oom_cap: int = 0                  # the OOM policy's share of it
    memory: MemoryStats = MemoryStats()
    invariant_batch_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=_empty)  # by runner (format)
    tokens_per_s: float = 0.0
    pace: Pace = Pace()               # per-row decode rate, for the deadline check (admission.py)
    ahead_tokens: int = 0             # tokens to generate before a newcomer gets a row (Scheduler.ahead_tokens)
    breaker: Mapping[str, BreakerState] = field(default_factory=_empty)  # by kind
    breaker_level: int = 0
    counters: CounterStats = CounterStats()
    prefix_cache: PrefixStats = PrefixStats()
    active_variant: str = "primary"   # the model variant new requests start on (variants.py)
