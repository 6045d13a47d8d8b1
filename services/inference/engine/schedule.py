"""Scheduling: pure bookkeeping of which requests wait, which are admitted, and what the next step runs.

`Scheduler.schedule(policy, cap)` returns a `StepPlan`: the newcomers whose prefill joins this step
(strict FIFO, at most `prefill_tokens_per_iteration` prompt tokens of newcomers' first chunks, the first
always goes); once they have rows, `StepPlan.batches(rows)` is the whole step: each row's `Work` (the
tokens it runs and the cache position they go to), grouped by runner and split into batches no
larger than the cap. It runs no model
and touches no tensor; the loop thread is its only caller.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.inference.engine.admission import Admission, Ticket, deadline_refusal
from services.inference.engine.breaker import Policy
from services.inference.engine.stats import Pace
from services.inference.model.kvpool import RowCache
from shared.errors import DeadlineExpired, Overloaded


@dataclass(eq=False)
class Row:
    """A request in the running batch: its cache and progress. Owned by the loop thread."""

    ticket: Ticket
    runner: str                    # the weight format whose LlamaRunner runs it (executor.py)
    cache: RowCache
    started: float
    breaker_level: int
    chunk_tokens: int              # prompt tokens prefilled per step at most (chunked prefill)
    prefilled: int = 0             # prompt tokens already in the cache
    generated: int = 0
    last_token: int = -1
    first_token_at: float = 0.0
    variant: str = "primary"       # the model variant active when the row was created; kept to its end
    block_keys: list[bytes] = field(default_factory=list)  # its prompt's prefix-cache keys (kv.py sets them)

    @property
    def step(self) -> int:
        """The step this row runs next: the completion index it produces (0 = its prefill)."""
        return self.generated

    @property
    def prefix_key(self) -> str:
        """What the prefix cache keys this row's blocks by: its runner, and its adapter (other keys/values)."""
        return self.runner if not self.ticket.slot else f"{self.runner}#{self.ticket.slot}"

    @property
    def scores_prompt(self) -> bool:
        """The request asked for its prompt's logprobs: its prefill scores every prompt token."""
        return self.ticket.req.controls.prompt_logprobs is not None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.ticket.req.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """What this row feeds to its next step: its next prompt chunk, then its last sampled token.

        Chunks start at multiples of chunk_tokens from position 0, whatever the batch, so a request's
        computation never depends on its batch-mates.
        """
        if self.prefilling:
            return self.ticket.req.prompt_ids[self.prefilled:self.prefilled + self.chunk_tokens]
        return [self.last_token]


@dataclass(frozen=True)
class Work:
    """One row's share of a step: the tokens it runs, written to its cache from position `start` on."""

    row: Row
    start: int
    tokens: tuple[int, ...]
    prefill: bool  # the tokens are a prompt chunk (else the row's last sampled token)

    @classmethod
    def of(cls, row: Row) -> Work:
        return cls(row, row.cache.length, tuple(row.tokens), row.prefilling)


@dataclass(frozen=True)
class Batch:
    runner: str
    work: tuple[Work, ...]

    @property
    def rows(self) -> tuple[Row, ...]:
        return tuple(w.row for w in self.work)


@dataclass(frozen=True)
class StepPlan:
    admitted: tuple[Ticket, ...]   # newcomers that get a row (and a cache) before this step
    policy: Policy                 # breaker policy in force for the step
    cap: int                       # largest batch of the step

    def batches(self, rows: list[Row]) -> list[Batch]:
        """The whole step once the newcomers have rows: every running row's work (its tokens and where
        they go), per runner, in batches of at most `cap`."""
        out = []
        for name in dict.fromkeys(r.runner for r in rows):
            group = tuple(Work.of(r) for r in rows if r.runner == name)
            out += [Batch(name, group[i:i + self.cap]) for i in range(0, len(group), self.cap)]
        return out


def batch_cap(max_batch_size: int, policy: Policy, oom_cap: int) -> int:
    """The largest batch of a step: the configured maximum, lowered by breaker level 2 and by OOM halving."""
    return min(max_batch_size, policy.max_batch_size or max_batch_size, oom_cap)


class Scheduler:
    def __init__(self, admission: Admission, prefill_tokens_per_iteration: int, share_prefixes: bool = False):
        self.admission = admission
        self.prefill_tokens = prefill_tokens_per_iteration
        # With a prefix cache: a newcomer waits for the prompt blocks another request is computing (held)
        self.share_prefixes = share_prefixes
        self.rows: list[Row] = []
        self.pending: list[Ticket] = []  # admitted (memory reserved), waiting for their prefill

    def submit(self, ticket: Ticket, cap: int, retry_after_ms: int, pace: Pace, now: float) -> None:
        """Admit now when nothing waits and it fits, else queue it. Raises Overloaded when it would
        have to queue and the queue is full (QUEUE_FULL first: it could not even wait), or when it
        cannot finish within its deadline at the measured pace."""
        now_ok = not self.admission.queue and len(self.rows) + len(self.pending) < cap \
            and self.admission.fits_now(ticket)
        if not now_ok and (err := self.admission.queue_full(len(self.admission.queue), self.admission.queued_tokens,
                                                            ticket, retry_after_ms)):
            raise err
        if err := self.deadline_refusal(ticket, self.ahead_tokens(cap), pace, now):
            raise err
        if now_ok:
            self.admission.reserve(ticket)
            self.pending.append(ticket)
        else:
            self.admission.enqueue(ticket, retry_after_ms)

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self.admission.remove(ticket)
        if ticket in self.pending:
            self.pending.remove(ticket)
            self.admission.release(ticket)

    def ahead_tokens(self, cap: int) -> int:
        """Tokens the engine generates before a newcomer gets a row: none when a slot is free and
        nothing waits, else what the queue asks for and the fewest a running row has left."""
        if not self.admission.queue and len(self.rows) + len(self.pending) < cap:
            return 0
        return self._queued_tokens_ahead()

    def deadline_refusal(self, ticket: Ticket, ahead_tokens: int, pace: Pace, now: float) -> Overloaded | None:
        """admission.deadline_refusal for `ticket` behind `ahead_tokens`, in the batch running now."""
        req = ticket.req
        remaining = None if req.deadline is None else req.deadline - now
        return deadline_refusal(remaining, req.max_tokens, ahead_tokens, len(self.rows) + len(self.pending), pace)

    def expire(self, now: float, retry_after_ms: int, pace: Pace
               ) -> tuple[list[tuple[Ticket, Exception]], list[tuple[Row, Exception | None]]]:
        """Queued tickets and running rows to end now: (ticket, error) and (row, error or None = cancelled).
        A queued ticket is also ended once it cannot finish within its deadline at the pace measured
        since (a burst is queued before enough steps were measured), each behind the ones before it."""
        tickets = [(t, e) for t, e in self.admission.expire(now, retry_after_ms) if e is not None]
        ahead = self._running_tokens_left()
        for ticket in list(self.admission.queue):
            if err := self.deadline_refusal(ticket, ahead, pace, now):
                self.admission.remove(ticket)
                tickets.append((ticket, err))
            else:
                ahead += ticket.req.max_tokens
        rows = []
        for row in self.rows:
            deadline = row.ticket.req.deadline
            if row.ticket.cancelled:
                rows.append((row, None))
            elif deadline is not None and now >= deadline:
                rows.append((row, DeadlineExpired(
                    f"deadline passed after {row.generated} tokens", reason="DEADLINE_EXPIRED",
                    metadata={"request_id": row.ticket.req.request_id, "completion_tokens": row.generated})))
        return tickets, rows

    def schedule(self, policy: Policy, cap: int) -> StepPlan:
        free = cap - len(self.rows) - len(self.pending)
        self.pending += self.admission.pop_ready(max(0, free))
        taken, tokens = [], 0
        while self.pending and (not taken or tokens + self._first_chunk(self.pending[0]) <= self.prefill_tokens):
            if self._held(self.pending[0], taken):
                break
            ticket = self.pending.pop(0)
            tokens += self._first_chunk(ticket)
            taken.append(ticket)
        return StepPlan(tuple(taken), policy, cap)

    def _held(self, ticket: Ticket, taken: list[Ticket]) -> bool:
        """Whether ``ticket`` waits (FIFO: so do those behind it) for prompt blocks a running row, or a
        newcomer taken this step, has yet to compute: taken once they are in the prefix cache, its
        prefill starts after them instead of computing them again beside it (the `n` choices of one
        prompt, one system prompt sent by many at once). A hit is bitwise the computation it replaces
        (prefix.py), so holding changes no answer. A request that scores its prompt takes no hits and
        is never held."""
        if not self.share_prefixes or ticket.req.controls.prompt_logprobs is not None:
            return False
        leaders = [(r.ticket, r.prefilled) for r in self.rows if r.prefilling] + [(t, 0) for t in taken]
        for other, prefilled in leaders:
            if other.slot == ticket.slot and prefilled < self._shared_blocks(ticket, other) * self.prefill_tokens:
                return True
        return False

    def _shared_blocks(self, ticket: Ticket, other: Ticket) -> int:
        """Prompt blocks (prefill chunks) ``ticket`` could find cached once ``other`` computed them: the
        leading whole blocks both prompts hold, the last token of ``ticket`` always left to compute."""
        b, ids, theirs = self.prefill_tokens, ticket.req.prompt_ids, other.req.prompt_ids
        n = 0
        while n < (len(ids) - 1) // b and ids[n * b:(n + 1) * b] == theirs[n * b:(n + 1) * b]:
            n += 1
        return n

    def _first_chunk(self, ticket: Ticket) -> int:
        return min(len(ticket.req.prompt_ids), self.prefill_tokens)

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def remove(self, row: Row) -> None:
        """The row leaves: its blocks go back to the pool and its reservation to admission."""
        if row in self.rows:
            self.rows.remove(row)
            row.cache.release()
            self.admission.release(row.ticket)

    def drain_all(self) -> list[Ticket]:
        """Take every queued, pending and running request out (shutdown); returns their tickets."""
        tickets = list(self.admission.queue) + self.pending + [r.ticket for r in self.rows]
        for t in list(self.admission.queue):
            self.admission.remove(t)
        for t in self.pending:
            self.admission.release(t)
        for r in list(self.rows):
            self.remove(r)
        self.pending = []
        return tickets

    def retry_after_ms(self, tokens_per_s: float) -> int:
        """Rough time to drain what is ahead at the measured throughput (never below 50 ms)."""
        return int(min(60_000, max(50, 1000 * self._queued_tokens_ahead() / max(tokens_per_s, 1e-3))))

    def _queued_tokens_ahead(self) -> int:
        """The queued requests' max_tokens and the fewest tokens a running row has left."""
        return sum(t.req.max_tokens for t in self.admission.queue) + self._running_tokens_left()

    def _running_tokens_left(self) -> int:
        return min((r.ticket.req.max_tokens - r.generated for r in self.rows), default=0)

    def idle_wait(self) -> float:
        expiry = self.admission.next_expiry()
        return 0.5 if expiry is None else min(0.5, max(0.001, expiry - time.monotonic()))

