"""A call's deadline, made once per call.

A client's own deadline is kept (at most ``max_deadline_ms``), less the answer margin. A call without
one (an OpenAI client that sends no ``x-keel-deadline-ms``, a gRPC stub without a timeout) gets the
default, which follows the served model and the host instead of one fixed figure:

    default_s = min(max(default_deadline_ms, deadline_pace_margin x max_tokens x s_per_token), max_deadline_ms)

where ``s_per_token`` is the seconds per generated token that this gateway's answers have taken
lately (an exponentially weighted mean over answers of at least MIN_PACE_TOKENS tokens, queueing and
prefill included). Until an answer is measured, and whenever the pace makes less, the default is
``default_deadline_ms``. A large model on a slow host thus gets the time its answers take, and the
inference stage's admission (which refuses a request that cannot finish within its deadline at the
measured pace) does not refuse default-deadline calls only because a fixed default was too short.
"""
from __future__ import annotations

import time
from dataclasses import replace

from services.gateway.contract import Limits
from services.gateway.values import Call

# Answers shorter than this are not counted: their time is mostly prefill and hops, not generation.
MIN_PACE_TOKENS = 16
PACE_WEIGHT = 0.2  # the newest answer's weight in the mean


def deadline_from(time_remaining: float | None, limits: Limits) -> tuple[float, bool]:
    """(absolute monotonic deadline, whether it is the default): the client's (at most
    ``max_deadline_ms``) less the answer margin, else ``default_deadline_ms`` from now, which
    ``Pace.fit`` extends once the call's max_tokens is known."""
    if time_remaining is None:
        return time.monotonic() + limits.default_deadline_ms / 1000, True
    time_remaining = min(time_remaining, limits.max_deadline_ms / 1000)
    return time.monotonic() + max(0.0, time_remaining - limits.answer_margin_ms / 1000), False


class Pace:
    """Seconds per generated token over this gateway's recent answers, and the default deadline it gives."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.s_per_token = 0.0  # 0: nothing measured yet

    def observe(self, elapsed_s: float, tokens: int) -> None:
        """Count one answer of ``tokens`` generated tokens that took ``elapsed_s`` from its generation
        call to its last token."""
        if tokens < MIN_PACE_TOKENS or elapsed_s <= 0:
            return
        pace = elapsed_s / tokens
        self.s_per_token = pace if not self.s_per_token else (1 - PACE_WEIGHT) * self.s_per_token + PACE_WEIGHT * pace

    def default_s(self, max_tokens: int) -> float:
        """The default deadline, in seconds, of a call that generates up to ``max_tokens`` tokens."""
        want = self.limits.deadline_pace_margin * max_tokens * self.s_per_token
        return min(max(self.limits.default_deadline_ms / 1000, want), self.limits.max_deadline_ms / 1000)

    def fit(self, call: Call, max_tokens: int) -> Call:
        """``call`` with its default deadline extended to ``default_s(max_tokens)`` from when it was
        made; a client's own deadline is never changed."""
        if not call.default_deadline:
            return call
        extra = self.default_s(max_tokens) - self.limits.default_deadline_ms / 1000
        return replace(call, deadline=call.deadline + extra) if extra > 0 else call
