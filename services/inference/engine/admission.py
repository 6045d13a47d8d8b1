"""Admission against the memory budget and the KV pool, and the bounded FIFO wait queue.

Each request is charged its predicted peak at full length (prompt + max_tokens, see memory.py) and
reserves the KV blocks of that length for as long as it runs, so a running batch can never outgrow the
budget and a running row never lacks a block. Not thread-safe by itself: the
step loop thread is its only user.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from services.inference.engine.api import GenerationRequest, TokenEvent
from services.inference.engine.controls import RowControls
from services.inference.engine.memory import MemoryModel
from services.inference.engine.stats import Pace
from shared.errors import DEADLINE_UNREACHABLE, DeadlineExpired, Overloaded, PreconditionFailed

# Decoding steps measured before the pace is believed; until then every request is admitted.
MIN_PACE_STEPS = 16


def deadline_refusal(remaining_s: float | None, max_tokens: int, ahead_tokens: int, batch: int,
                     pace: Pace) -> Overloaded | None:
    """The refusal of a request that cannot finish within its deadline at the measured pace, or
    None to admit it (docs/inference.md, Admission by deadline):

        finish_s = ahead_tokens / (row_tokens_per_s * batch) + max_tokens / row_tokens_per_s

    ``remaining_s``: what is left of its deadline (None: it has none); ``ahead_tokens``: the tokens
    the engine generates before it gets a row (0 when a slot is free and nothing waits), drained by
    the ``batch`` rows running meanwhile; ``pace``: the per-row decode rate at that batch. Admitted
    without an estimate: no deadline, a pace of fewer than MIN_PACE_STEPS steps, an idle engine
    (batch 0: the pace was measured under another load). The retry hint is the wait for a row."""
    rate = pace.row_tokens_per_s
    if remaining_s is None or pace.steps < MIN_PACE_STEPS or rate <= 0 or batch == 0:
        return None
    wait_s = ahead_tokens / (rate * batch)
    finish_s = wait_s + max_tokens / rate
    if finish_s <= remaining_s:
        return None
    return Overloaded(
        f"the request cannot finish within its deadline: {max_tokens} tokens at the measured "
        f"{rate:.1f} tokens/s per row need ~{finish_s:.1f}s ({wait_s:.1f}s of them waiting for a row), "
        f"the deadline leaves {max(remaining_s, 0):.1f}s; lower max_tokens or allow a longer deadline",
        reason=DEADLINE_UNREACHABLE, retry_after_ms=max(50, round(1000 * wait_s)),
        metadata={"estimated_ms": round(1000 * finish_s), "remaining_ms": round(1000 * max(remaining_s, 0)),
                  "row_tokens_per_s": f"{rate:.2f}", "ahead_tokens": ahead_tokens})


@dataclass(frozen=True)
class QueueLimits:
    max_queued_requests: int
    max_queued_tokens: int
    queue_timeout_ms: int


@dataclass(eq=False)
class Ticket:
    """One submitted request; events go to `events` on the consumer's asyncio loop."""

    req: GenerationRequest
    seed: int
    cost_bytes: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    holds_reservation: bool = False
    ended: bool = False   # the step loop queued a terminal item (Finished or an error) for it
    closed: bool = False  # a terminal item was sent
    blocks: int = 0       # KV blocks reserved for prompt + max_tokens positions
    slot: int = 0         # adapter slot the request runs with (0 = the base model; lora/registry.py)
    adapter: str = ""     # that adapter as "id@version" ("" = the base model)
    controls: RowControls | None = None  # the request's penalties, grammar, stops, logprobs (controls.py)

    def send(self, item) -> None:
        """Thread-safe delivery; once a terminal item is sent nothing else is."""
        if self.closed:
            return
        if not isinstance(item, TokenEvent):
            self.closed = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            self.closed = True


class Admission:
    def __init__(self, memory: MemoryModel, budget_bytes: int, limits: QueueLimits, pool_blocks: int,
                 kept_bytes: int = 0):
        self.memory = memory
        self.budget = budget_bytes
        self.pool_blocks = pool_blocks  # blocks of each runner's KV pool
        self.reserved_blocks = 0        # blocks reserved by running requests (whichever pool they use)
        self.kept = kept_bytes  # room kept aside for the prefix cache, never lent to requests
        self.limits = limits
        self.queue: deque[Ticket] = deque()
        self.queued_tokens = 0
        self.reserved = 0  # bytes charged to running requests, static excluded

    @property
    def predicted_bytes(self) -> int:
        return self.memory.static_bytes + self.kept + self.reserved

    def cost(self, req: GenerationRequest) -> int:
        return self.memory.request_bytes(len(req.prompt_ids), req.max_tokens)

    def blocks(self, req: GenerationRequest) -> int:
        return self.memory.cache_positions(req.total_tokens) // self.memory.block_tokens

    def check_fits_ever(self, req: GenerationRequest) -> None:
        if self.memory.static_bytes + self.kept + self.cost(req) > self.budget or self.blocks(req) > self.pool_blocks:
            max_total = self.memory.max_total_tokens(self.budget - self.kept)
            raise PreconditionFailed(
                f"request needs ~{self.cost(req)} bytes beyond the model; the budget leaves room for "
                f"about {max_total} tokens (prompt + max_tokens)",
                reason="REQUEST_EXCEEDS_MEMORY_BUDGET",
                metadata={"max_total_tokens": max_total, "request_id": req.request_id})

    def fits_now(self, ticket: Ticket) -> bool:
        return self.predicted_bytes + ticket.cost_bytes <= self.budget and \
            self.reserved_blocks + ticket.blocks <= self.pool_blocks

    def queue_full(self, depth: int, queued_tokens: int, ticket: Ticket, retry_after_ms: int) -> Overloaded | None:
        """The refusal of `ticket` by a queue holding `depth` requests of `queued_tokens` tokens, or None
        when it has room. Reads only the fixed limits, so any thread may ask it about published counts."""
        lim = self.limits
        if depth < lim.max_queued_requests and queued_tokens + ticket.req.total_tokens <= lim.max_queued_tokens:
            return None
        return Overloaded(f"inference queue is full ({depth} requests, {queued_tokens} tokens)",
                          reason="QUEUE_FULL", retry_after_ms=retry_after_ms,
                          metadata={"queued_requests": depth, "queued_tokens": queued_tokens})

    def enqueue(self, ticket: Ticket, retry_after_ms: int) -> None:
        """Queue the ticket or raise Overloaded when the queue is at its limits."""
        if err := self.queue_full(len(self.queue), self.queued_tokens, ticket, retry_after_ms):
            raise err
        self.queue.append(ticket)
        self.queued_tokens += ticket.req.total_tokens

    def pop_ready(self, free_slots: int) -> list[Ticket]:
        """Strict FIFO: take queued tickets from the head while they fit (no overtaking)."""
        taken = []
        while self.queue and len(taken) < free_slots and self.fits_now(self.queue[0]):
            ticket = self._pop_head()
            self.reserve(ticket)
            taken.append(ticket)
        return taken

    def reserve(self, ticket: Ticket) -> None:
        ticket.holds_reservation = True
        self.reserved += ticket.cost_bytes
        self.reserved_blocks += ticket.blocks

    def release(self, ticket: Ticket) -> None:
        """Idempotent: a ticket gives its bytes back once, whichever path ends it."""
        if ticket.holds_reservation:
            ticket.holds_reservation = False
            self.reserved -= ticket.cost_bytes
            self.reserved_blocks -= ticket.blocks

    def remove(self, ticket: Ticket) -> bool:
        if ticket in self.queue:
            self.queue.remove(ticket)
            self.queued_tokens -= ticket.req.total_tokens
            return True
        return False

    def expire(self, now: float, retry_after_ms: int) -> list[tuple[Ticket, Exception]]:
        """Drop cancelled, timed-out and past-deadline tickets from the queue; returns them with their error."""
        out = []
        timeout_s = self.limits.queue_timeout_ms / 1000
        for ticket in list(self.queue):
            err = None
            if ticket.req.deadline is not None and now >= ticket.req.deadline:
                err = DeadlineExpired("deadline passed while queued", reason="DEADLINE_EXPIRED_IN_QUEUE",
                                      metadata={"request_id": ticket.req.request_id})
            elif now - ticket.submitted >= timeout_s:
                err = Overloaded(f"waited {timeout_s:g}s in the inference queue", reason="QUEUE_TIMEOUT",
                                 retry_after_ms=retry_after_ms, metadata={"request_id": ticket.req.request_id})
            if err is not None or ticket.cancelled:
                self.remove(ticket)
                out.append((ticket, err))
        return out

    def next_expiry(self) -> float | None:
        """Monotonic time at which the earliest queued ticket expires, for the idle wait."""
        times = [t.submitted + self.limits.queue_timeout_ms / 1000 for t in self.queue]
        times += [t.req.deadline for t in self.queue if t.req.deadline is not None]
        return min(times, default=None)

    def _pop_head(self) -> Ticket:
        ticket = self.queue.popleft()
        self.queued_tokens -= ticket.req.total_tokens
        return ticket
