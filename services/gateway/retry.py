"""The gateway's retry policy (pure decisions) and the executor that applies it to one call.

Policy per gRPC status of a failed attempt (``KeelError.code``):

- UNAVAILABLE: full-jitter exponential backoff, delay ~ U(0, min(cap, base * 2**n)) for the
  n-th retry (n from 0), base 100 ms, cap 1 s, at most 3 attempts. A server hint, if any, is
  honoured as for RESOURCE_EXHAUSTED (gRFC A6 pushback): a valid one replaces the backoff,
  an invalid (negative/unparseable) one stops.
- RESOURCE_EXHAUSTED: only with a valid server hint: delay = min(hint, 30 s) * U(1, 1.5), at
  most 2 attempts; an invalid hint stops (``pushback_stop``); no hint or a message-size
  error is never retried.
- DEADLINE_EXCEEDED: linear backoff (step * n), only for an idempotent call whose attempt ran
  out of its own per-attempt timeout while the overall deadline still had time.
- Anything else (INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED,
  OUT_OF_RANGE, INTERNAL, CANCELLED, NOT_FOUND, ...): never retried.
- Inference's DEADLINE_UNREACHABLE (the request cannot finish by its deadline at the measured
  decode rate) stops at once (``deadline``): a retry would have less time, not more.
- A local "no upstream to send to" (reason NO_HEALTHY_UPSTREAM) stops at once
  (``circuit_open``) and costs no retry token, since no upstream answered.
- A replica that went away mid-call (reason CONNECTION_LOST: no server answered; or SHUTTING_DOWN:
  a draining stage cut the call) is not an overloaded upstream: the call is re-dispatched once, at
  once, to the next SERVING replica (or the restarted one, held for within the deadline), like
  gRPC's transparent retry. That re-dispatch costs no retry token and no attempt of the caps
  below (``replica_lost``); a second such failure goes through the policy like any UNAVAILABLE
  (backoff, attempt caps) except the throttle: a dead replica neither spends nor needs a token.

Then, in order: the per-code and per-request attempt caps (``max_attempts``), the upstream's
A6 token bucket (``budget``) and the deadline: a retry whose delay plus the upstream's
expected latency does not fit in the time left (minus a margin) is not made (``deadline``).
A request that arrived as a retry (``grpc-previous-rpc-attempts`` > 0) gets one attempt.

Every decision is one log record on ``keel.gateway.retry`` with ``event="retry_decision"``
and the fields of :class:`DecisionRecord`; the JSON log formatter (shared/logging.py) renders the extras.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

from services.gateway.auth import Metadata
from services.gateway.budget import LatencyEstimate, ThrottleConfig, ThrottleRegistry, attempt_metadata, is_retry
from services.gateway.retry_alerts import AlertConfig, RetryInterval, RetryMonitor
from shared import errors
from shared.errors import DeadlineExpired, KeelError

log = logging.getLogger("keel.gateway.retry")
T = TypeVar("T")

RETRYABLE_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
LOCAL_NO_UPSTREAM_REASONS = frozenset({"NO_HEALTHY_UPSTREAM"})
REPLICA_LOST_REASONS = frozenset({errors.CONNECTION_LOST, errors.SHUTTING_DOWN})


@dataclass(frozen=True)
class RetryConfig:
    base_s: float = 0.1
    cap_s: float = 1.0
    unavailable_max_attempts: int = 3
    pushback_cap_s: float = 30.0
    pushback_jitter_max: float = 1.5
    exhausted_max_attempts: int = 2
    deadline_step_s: float = 0.05
    deadline_max_attempts: int = 3
    max_attempts_per_request: int = 3
    deadline_margin_s: float = 0.02
    per_attempt_timeout_s: float | None = None
    throttle: ThrottleConfig = ThrottleConfig()
    alerts: AlertConfig = AlertConfig()

    def __post_init__(self) -> None:
        # Each field's own bounds are config/schemas/gateway.schema.json's; this is the rule between two.
        if self.cap_s < self.base_s:
            raise ValueError("retry config breaks cap_s >= base_s")


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt. ``low_s``..``high_s`` is the range the delay came from."""

    retry: bool
    reason: str | None = None  # set when not retrying
    delay_s: float = 0.0
    delay_source: str = "none"  # "exponential_jitter" | "pushback" | "linear" | "none"
    low_s: float = 0.0
    high_s: float = 0.0
    current_backoff_ms: float | None = None


def _stop(reason: str, **fields) -> Decision:
    return Decision(retry=False, reason=reason, **fields)


def hint_state(err: KeelError) -> str:
    """"absent" | "valid" | "invalid". The client layer sets retry_after_ms only for a valid hint
    and says "invalid" in metadata; locally raised errors carry just retry_after_ms."""
    if err.metadata.get("retry_hint") == "invalid":
        return "invalid"
    if err.retry_after_ms is None:
        return "absent"
    return "valid" if err.retry_after_ms >= 0 else "invalid"


def _pushback(err: KeelError, cfg: RetryConfig, rng: random.Random) -> Decision:
    low = min(err.retry_after_ms / 1000.0, cfg.pushback_cap_s)
    high = low * cfg.pushback_jitter_max
    return Decision(retry=True, delay_s=low * rng.uniform(1.0, cfg.pushback_jitter_max),
                    delay_source="pushback", low_s=low, high_s=high)


def _code_limit(err: KeelError, cfg: RetryConfig) -> int:
    return {"UNAVAILABLE": cfg.unavailable_max_attempts,
            "RESOURCE_EXHAUSTED": cfg.exhausted_max_attempts,
            "DEADLINE_EXCEEDED": cfg.deadline_max_attempts}[err.code]


def decide(err: KeelError, *, attempt: int, max_attempts: int, idempotent: bool,
           attempt_timed_out_early: bool, budget_ok: bool, remaining_s: float,
           expected_latency_s: float, cfg: RetryConfig, rng: random.Random) -> Decision:
    """Pure decision after attempt number ``attempt`` (1-based) failed with ``err``.

    ``max_attempts`` is the request's own cap (1 for a request that arrived as a retry);
    ``attempt_timed_out_early``: the attempt's timeout was its per-attempt limit, shorter than
    the time left; ``remaining_s`` is the time to the deadline minus the margin. ``rng`` is
    drawn from only when a delay is about to be computed, so seeded tests can replay draws.
    """
    if err.reason in LOCAL_NO_UPSTREAM_REASONS:
        return _stop("circuit_open")
    if err.code not in RETRYABLE_CODES:
        return _stop("non_retryable")
    if err.reason == errors.DEADLINE_UNREACHABLE:  # inference's estimate: less time left can only do worse
        return _stop("deadline")
    hint = hint_state(err)
    if err.code == "RESOURCE_EXHAUSTED" and (hint == "absent" or err.metadata.get("message_size") == "1"):
        return _stop("non_retryable")
    if hint == "invalid" and err.code != "DEADLINE_EXCEEDED":
        return _stop("pushback_stop")
    if err.code == "DEADLINE_EXCEEDED":
        if not idempotent:
            return _stop("non_retryable")
        if not attempt_timed_out_early:
            return _stop("deadline")
    if attempt >= min(_code_limit(err, cfg), max_attempts):
        return _stop("max_attempts")
    if not budget_ok:
        return _stop("budget")
    if err.code == "DEADLINE_EXCEEDED":
        delay = cfg.deadline_step_s * attempt
        plan = Decision(retry=True, delay_s=delay, delay_source="linear", low_s=delay, high_s=delay)
    elif hint == "valid":
        plan = _pushback(err, cfg, rng)
    else:
        backoff = min(cfg.cap_s, cfg.base_s * 2 ** (attempt - 1))
        plan = Decision(retry=True, delay_s=rng.uniform(0.0, backoff), delay_source="exponential_jitter",
                        high_s=backoff, current_backoff_ms=backoff * 1000.0)
    if plan.delay_s + expected_latency_s >= remaining_s:
        return _stop("deadline", delay_s=plan.delay_s, delay_source=plan.delay_source,
                     low_s=plan.low_s, high_s=plan.high_s, current_backoff_ms=plan.current_backoff_ms)
    return plan


@dataclass(frozen=True)
class DecisionRecord:
    """The fields of one ``retry_decision`` log record."""

    trace_id: str
    method: str
    upstream: str
    attempt: int
    code: str
    decision: str  # "retry" | "stop"
    reason: str | None
    delay_ms: float
    delay_source: str
    retry_after_ms: int | None
    current_backoff_ms: float | None
    upstream_latency_ms: float
    tokens_before: float
    tokens_after: float


class RetryExecutor:
    """Runs one call's attempts under the policy. One per gateway; clock/sleep/rng injectable."""

    def __init__(self, config: RetryConfig = RetryConfig(), *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 rng: random.Random | None = None,
                 monitor: RetryMonitor | None = None,
                 on_decision: Callable[[DecisionRecord], None] | None = None):
        self.config = config
        self._on_decision = on_decision
        self._clock = clock
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self.throttles = ThrottleRegistry(config.throttle)
        self.latency = LatencyEstimate()
        self.monitor = monitor if monitor is not None else RetryMonitor(config.alerts, clock)

    async def call_with_retries(self, attempt_fn: Callable[[float, dict], Awaitable[T]], *,
                                method: str, upstream: str, idempotent: bool, deadline: float,
                                trace_id: str, inbound_metadata: Metadata = None,
                                attempt_timeout_s: float | None = None) -> T:
        """Make attempts until one succeeds or the policy stops; re-raise the last error then.

        ``deadline`` is absolute, on this executor's clock (``time.monotonic`` by default).
        ``attempt_fn(timeout_s, extra_metadata)`` makes one attempt with that timeout, attaching
        ``extra_metadata`` (the previous-attempts markers on retries), and raises KeelError on
        failure. The raised error carries ``metadata["retry_stop"]`` (the reason) and
        ``metadata["attempts"]``. ``inbound_metadata`` is the incoming request's metadata: if it
        marks a retry, this call gets a single attempt. ``attempt_timeout_s`` overrides the
        config's per-attempt timeout for this call (None: the config's, which may be None).
        """
        cfg = self.config
        throttle = self.throttles.get(upstream)
        max_attempts = 1 if is_retry(inbound_metadata) else cfg.max_attempts_per_request
        self.monitor.record_request(upstream)
        attempt = 0
        redispatched = 0  # attempts that re-sent a call whose replica went away (at most 1)
        while True:
            attempt += 1
            remaining = deadline - self._clock() - cfg.deadline_margin_s
            if remaining <= 0:
                raise self._no_time(method, upstream, trace_id, attempt, throttle.tokens)
            limit = cfg.per_attempt_timeout_s if attempt_timeout_s is None else attempt_timeout_s
            timeout = remaining if limit is None or limit >= remaining else limit
            started = self._clock()
            try:
                result = await attempt_fn(timeout, attempt_metadata(attempt - 1))
            except KeelError as err:
                latency = self._clock() - started
                tokens_before = throttle.tokens
                if err.reason in REPLICA_LOST_REASONS and not redispatched:
                    redispatched = 1
                    self._log(DecisionRecord(
                        trace_id=trace_id, method=method, upstream=upstream, attempt=attempt, code=err.code,
                        decision="retry", reason="replica_lost", delay_ms=0.0, delay_source="none",
                        retry_after_ms=err.retry_after_ms, current_backoff_ms=None,
                        upstream_latency_ms=latency * 1000.0, tokens_before=tokens_before,
                        tokens_after=tokens_before))
                    continue
                lost = err.reason in REPLICA_LOST_REASONS  # a dead replica, not an overloaded one
                if err.code in RETRYABLE_CODES and err.reason not in LOCAL_NO_UPSTREAM_REASONS and not lost:
                    throttle.on_failure()
                decision = decide(
                    err, attempt=attempt - redispatched, max_attempts=max_attempts, idempotent=idempotent,
                    attempt_timed_out_early=timeout < remaining, budget_ok=lost or throttle.allows_retry(),
                    remaining_s=deadline - self._clock() - cfg.deadline_margin_s,
                    expected_latency_s=self.latency.expected(upstream, method), cfg=cfg, rng=self._rng)
                self._log(DecisionRecord(
                    trace_id=trace_id, method=method, upstream=upstream, attempt=attempt,
                    code=err.code, decision="retry" if decision.retry else "stop",
                    reason=decision.reason, delay_ms=decision.delay_s * 1000.0,
                    delay_source=decision.delay_source, retry_after_ms=err.retry_after_ms,
                    current_backoff_ms=decision.current_backoff_ms,
                    upstream_latency_ms=latency * 1000.0, tokens_before=tokens_before,
                    tokens_after=throttle.tokens))
                if not decision.retry:
                    err.metadata.update(retry_stop=decision.reason, attempts=str(attempt))
                    raise
                await self._wait(upstream, err.code, decision)
                continue
            self.latency.observe(upstream, method, self._clock() - started)
            throttle.on_success()
            return result

    async def _wait(self, upstream: str, code: str, decision: Decision) -> None:
        before = self._clock()
        await self._sleep(decision.delay_s)
        actual = self._clock() - before
        self.monitor.record_retry(upstream, code, RetryInterval(actual, decision.low_s, decision.high_s))

    def _no_time(self, method: str, upstream: str, trace_id: str, attempt: int,
                 tokens: float) -> DeadlineExpired:
        self._log(DecisionRecord(
            trace_id=trace_id, method=method, upstream=upstream, attempt=attempt, code="",
            decision="stop", reason="deadline", delay_ms=0.0, delay_source="none",
            retry_after_ms=None, current_backoff_ms=None, upstream_latency_ms=0.0,
            tokens_before=tokens, tokens_after=tokens))
        return DeadlineExpired(f"no time left for attempt {attempt} to {upstream}",
                               metadata={"upstream": upstream, "retry_stop": "deadline",
                                         "attempts": str(attempt - 1)})

    def _log(self, record: DecisionRecord) -> None:
        if self._on_decision is not None:
            self._on_decision(record)
        fields = asdict(record)
        log.info("retry %s %s attempt %d %s: %s", fields["decision"], record.upstream,
                 record.attempt, record.code or "-", record.reason or "retryable",
                 extra={"event": "retry_decision", **fields})
