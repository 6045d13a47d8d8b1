"""The batching loop: one dedicated thread runs every forward pass (iteration-level batching).

Each iteration: drop cancelled / expired rows, admit what fits, then one forward pass over every row,
split into chunks no larger than the current batch cap: newcomers contribute their whole prompt
(prefill), running rows their last token (decode), and every row gets its next token. Rows leave
the moment they finish, fail or are cancelled; their cache goes with them.
"""
from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from shared.errors import DeadlineExpired, Fatal, NotReady, NumericalInstability, Overloaded

from .admission import Admission, Ticket
from .api import Finished, TokenEvent
from .breaker import BreakerBoard, Policy
from .faults import RowFaults, injected_oom, is_oom
from .forward import LlamaRunner, RowCache, Segment
from .memory import PeakMeter
from .sampling import clamp_temperature, pick, row_is_finite
from .torchthread import TorchThread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch_size: int
    eos_token_ids: tuple[int, ...]
    prefill_tokens_per_iteration: int
    oom_backoff_steps: int
    memory_audit: bool
    device: str


@dataclass(eq=False)
class Row:
    ticket: Ticket
    runner: str
    cache: RowCache
    faults: RowFaults
    started: float
    breaker_level: int
    generated: int = 0
    last_token: int = -1
    first_token_at: float = 0.0


@dataclass
class Counters:
    admitted: int = 0
    completed: int = 0
    tokens: int = 0
    numerical_faults: int = 0
    oom_events: int = 0
    oom_recoveries: int = 0
    failed: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, runners: dict[str, LlamaRunner], admission: Admission, board: BreakerBoard,
                 settings: SchedulerSettings, tokens_per_s: float):
        self.runners = runners
        self.admission = admission
        self.board = board
        self.settings = settings
        self.lock = threading.RLock()  # re-entrant: helpers lock again while the loop holds it
        self.cond = threading.Condition(self.lock)
        self.rows: list[Row] = []
        self.pending: list[Ticket] = []   # admitted (memory reserved), waiting for their prefill
        self.prefilling: list[Ticket] = []  # taken from pending by the current iteration
        self.counters = Counters()
        self.tokens_per_s = tokens_per_s
        self.oom_cap = settings.max_batch_size
        self.steps_since_oom = 0
        self.observed_peak_bytes = 0
        self._stop = False
        self._owned_thread: TorchThread | None = None  # made by start() when given none; closed at shutdown
        self._loop_done: Future | None = None

    # ---- called from the asyncio side (any thread) ----
    def start(self, thread: TorchThread | None = None) -> None:
        """Run the loop on the process's torch thread, or on a thread of its own."""
        if thread is None:
            thread = self._owned_thread = TorchThread("keel-inference")
        self._loop_done = thread.submit(self._loop)

    def submit(self, ticket: Ticket, policy: Policy) -> None:
        with self.cond:
            if self._stop:
                raise NotReady("inference engine is stopping", reason="SHUTTING_DOWN", retry_after_ms=1000)
            self.admission.check_fits_ever(ticket.req)
            running = len(self.rows) + len(self.pending) + len(self.prefilling)
            if not self.admission.queue and running < self.batch_cap(policy) and self.admission.fits_now(ticket):
                self.admission.reserve(ticket)
                self.pending.append(ticket)
            else:
                self.admission.enqueue(ticket, self.retry_after_ms())
            self.counters.admitted += 1
            self.cond.notify()

    def cancel(self, ticket: Ticket) -> None:
        """Queued: removed now. Running: removed (cache freed) before the next forward pass."""
        with self.cond:
            ticket.cancelled = True
            self.admission.remove(ticket)
            self.cond.notify()

    def busy(self) -> bool:
        with self.lock:
            return bool(self.rows or self.pending or self.prefilling or self.admission.queue)

    def shutdown(self, error: Exception) -> None:
        """Stop the thread; every request still queued or running gets `error`."""
        with self.cond:
            self._stop = True
            self._shutdown_error = error
            self.cond.notify()
        if self._loop_done is not None:
            self._loop_done.result()
        if self._owned_thread is not None:
            self._owned_thread.close()

    def batch_cap(self, policy: Policy) -> int:
        return min(self.settings.max_batch_size, policy.max_batch_size or self.settings.max_batch_size,
                   self.oom_cap)

    def retry_after_ms(self) -> int:
        """Rough time to drain what is ahead at the measured throughput (never below 50 ms)."""
        ahead = sum(t.req.max_tokens for t in self.admission.queue)
        ahead += min((r.ticket.req.max_tokens - r.generated for r in self.rows), default=0)
        return int(min(60_000, max(50, 1000 * ahead / max(self.tokens_per_s, 1e-3))))

    # ---- the loop thread ----
    def _loop(self) -> None:
        while True:
            with self.cond:
                if self._stop:
                    self._fail_all(self._shutdown_error)
                    return
                policy = self.board.policy()
                self._drop_finished_queue_and_rows()
                admitted = self._take_admitted(policy)
                if not self.rows and not admitted:
                    self.cond.wait(timeout=self._idle_wait())
                    continue
            try:
                self._iterate(admitted, policy)
                with self.lock:
                    self.prefilling = []
            except Exception as exc:  # a bug must fail the requests involved, not kill the loop
                log.exception("inference step failed", extra={"batch_size": len(self.rows)})
                err = Fatal(f"inference step failed: {type(exc).__name__}: {exc}", reason="STEP_FAILED")
                for ticket in admitted:
                    self._fail_ticket(ticket, err)
                for row in list(self.rows):
                    self._fail_row(row, err)
                with self.lock:
                    self.prefilling = []

    def _iterate(self, admitted: list[Ticket], policy: Policy) -> None:
        if not self.settings.memory_audit:
            self._step(admitted, policy)
            return
        live = sum(r.cache.nbytes for r in self.rows) + self.admission.memory.static_bytes
        with PeakMeter(self.settings.device) as meter:
            self._step(admitted, policy)
        self.observed_peak_bytes = max(self.observed_peak_bytes, live + meter.peak)

    def _step(self, admitted: list[Ticket], policy: Policy) -> None:
        """One forward pass per chunk of rows; newcomers' prompts ride along with the decode rows."""
        for ticket in admitted:
            self._admit_row(ticket, policy)
        rows = [r for r in self.rows if not r.ticket.cancelled]
        if not rows:
            return
        decoding = sum(1 for r in rows if r.generated)
        t0 = time.monotonic()
        cap = self.batch_cap(policy)
        for name in self.runners:
            group = [r for r in rows if r.runner == name]
            for i in range(0, len(group), cap):
                self._forward(group[i:i + cap], policy)
        if decoding:
            rate = decoding / max(time.monotonic() - t0, 1e-6)
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * rate
        self._recover_cap()

    def _take_admitted(self, policy: Policy) -> list[Ticket]:
        free = self.batch_cap(policy) - len(self.rows) - len(self.pending)
        self.pending += self.admission.pop_ready(max(0, free))
        taken, tokens = [], 0
        while self.pending and (not taken or tokens + len(self.pending[0].req.prompt_ids)
                                <= self.settings.prefill_tokens_per_iteration):
            ticket = self.pending.pop(0)
            tokens += len(ticket.req.prompt_ids)
            taken.append(ticket)
        self.prefilling = taken
        return taken

    def _drop_finished_queue_and_rows(self) -> None:
        now = time.monotonic()
        for ticket, err in self.admission.expire(now, self.retry_after_ms()):
            if err is not None:
                self._fail_ticket(ticket, err)
        for ticket in [t for t in self.pending if t.cancelled]:
            self.pending.remove(ticket)
            self.admission.release(ticket)
        for row in list(self.rows):
            deadline = row.ticket.req.deadline
            if row.ticket.cancelled:
                self._remove(row)
            elif deadline is not None and now >= deadline:
                self._fail_row(row, DeadlineExpired(
                    f"deadline passed after {row.generated} tokens", reason="DEADLINE_EXPIRED",
                    metadata={"request_id": row.ticket.req.request_id, "completion_tokens": row.generated}))

    def _idle_wait(self) -> float:
        expiry = self.admission.next_expiry()
        return 0.5 if expiry is None else min(0.5, max(0.001, expiry - time.monotonic()))

    def _admit_row(self, ticket: Ticket, policy: Policy) -> None:
        """Give an admitted request its cache (for prompt + max_tokens) and a place in the batch."""
        req = ticket.req
        name = "fallback" if policy.use_fallback and "fallback" in self.runners else "primary"
        runner = self.runners[name]
        try:
            cache = runner.new_cache(len(req.prompt_ids) + req.max_tokens)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._on_oom(exc, 1)
            self._fail_ticket(ticket, self._oom_error(req.request_id))
            return
        self.rows.append(Row(ticket, name, cache, RowFaults(req.faults), time.monotonic(), policy.level))

    def _forward(self, rows: list[Row], policy: Policy) -> None:
        """Step k of each row (k = tokens generated so far; 0 is its prefill), then sample."""
        runner = self.runners[rows[0].runner]
        delay = max(r.faults.slow_s for r in rows)
        if delay:
            time.sleep(delay)
        try:
            for r in rows:
                if r.faults.take_oom(r.generated):
                    raise injected_oom(r.ticket.req.request_id, r.generated)
            logits = runner.forward([
                Segment(r.cache, [r.last_token] if r.generated else r.ticket.req.prompt_ids,
                        r.faults.nan_at(r.generated)) for r in rows])
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._on_oom(exc, len(rows))
            if len(rows) == 1:
                self._fail_row(rows[0], self._oom_error(rows[0].ticket.req.request_id))
                return
            # Nothing was committed (cache lengths advance only on success): retry in halves.
            self.counters.oom_recoveries += 1
            half = len(rows) // 2
            self._forward(rows[:half], policy)
            self._forward(rows[half:], policy)
            return
        for r, lg in zip(rows, logits):
            self._emit(r, lg, policy, step=r.generated, batch=len(rows))

    def _emit(self, row: Row, logits: torch.Tensor, policy: Policy, step: int, batch: int) -> None:
        req = row.ticket.req
        if not bool(row_is_finite(logits[None])[0]):
            self.counters.numerical_faults += 1
            self.board.record("numerical_instability", f"non-finite logits, request {req.request_id}")
            log.warning("non-finite logits; failing the row", extra={
                "request_id": req.request_id, "trace_id": req.trace_id, "fingerprint": req.fingerprint,
                "step": step, "batch_size": batch})
            self._fail_row(row, NumericalInstability(
                "the model produced non-finite logits for this input", reason="NON_FINITE_LOGITS",
                metadata={"request_id": req.request_id, "fingerprint": req.fingerprint, "step": step}))
            return
        temperature = clamp_temperature(req.temperature, policy.temperature_cap)
        try:
            p = pick(logits, temperature, req.top_p, req.top_k, row.ticket.seed,
                     len(req.prompt_ids) + row.generated, policy.logit_clamp)
        except Exception as exc:  # a sampling bug fails this row only, never its batch-mates
            log.exception("sampling failed", extra={"request_id": req.request_id, "step": step})
            self._fail_row(row, Fatal(f"sampling failed: {type(exc).__name__}: {exc}", reason="SAMPLING_FAILED",
                                      metadata={"request_id": req.request_id, "step": step}))
            return
        now = time.monotonic()
        if row.generated == 0:
            row.first_token_at = now
        row.generated += 1
        row.last_token = p.token_id
        if p.token_id in self.settings.eos_token_ids or p.token_id in req.stop_token_ids:
            self._finish(row, "stop")
            return
        self.counters.tokens += 1
        row.ticket.send(TokenEvent(p.token_id, p.logprob, p.entropy, row.generated - 1))
        if row.generated >= req.max_tokens:
            self._finish(row, "length")

    def _finish(self, row: Row, reason: str) -> None:
        t = row.ticket
        completion = row.generated - (1 if reason == "stop" else 0)
        runner = self.runners[row.runner]
        with self.lock:
            self.counters.completed += 1
            self._remove(row)  # before the consumer hears of it: a finished row has left the batch
        t.send(Finished(reason, len(t.req.prompt_ids), completion, t.seed,
                        queue_ms=(row.started - t.submitted) * 1000,
                        ttft_ms=(row.first_token_at - t.submitted) * 1000,
                        dtype=runner.dtype_name, breaker_level=row.breaker_level))

    def _fail_row(self, row: Row, err: Exception) -> None:
        self._remove(row)
        self._fail_ticket(row.ticket, err)

    def _fail_ticket(self, ticket: Ticket, err: Exception) -> None:
        with self.lock:
            if ticket in self.pending:
                self.pending.remove(ticket)
            self.admission.release(ticket)
            if ticket.closed:
                return
            name = getattr(err, "reason", type(err).__name__)
            self.counters.failed[name] = self.counters.failed.get(name, 0) + 1
        if isinstance(err, DeadlineExpired):
            self.board.record("timeout", err.reason)
        ticket.send(err)

    def _remove(self, row: Row) -> None:
        with self.lock:
            if row in self.rows:
                self.rows.remove(row)
                self.admission.release(row.ticket)

    def _on_oom(self, exc: BaseException, batch: int) -> None:
        self.counters.oom_events += 1
        self.board.record("oom", f"{type(exc).__name__} at batch {batch}")
        self.oom_cap = max(1, batch // 2)
        self.steps_since_oom = 0
        log.warning("out of memory at batch %d; batch cap now %d", batch, self.oom_cap,
                    extra={"batch_size": batch, "batch_cap": self.oom_cap, "error": str(exc)})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _recover_cap(self) -> None:
        if self.oom_cap >= self.settings.max_batch_size:
            return
        self.steps_since_oom += 1
        if self.steps_since_oom >= self.settings.oom_backoff_steps:
            self.oom_cap = min(self.settings.max_batch_size, self.oom_cap * 2)
            self.steps_since_oom = 0

    def _oom_error(self, request_id: str) -> Overloaded:
        return Overloaded("out of memory even at batch size 1", reason="OUT_OF_MEMORY",
                          retry_after_ms=self.retry_after_ms(), metadata={"request_id": request_id})

    def _fail_all(self, err: Exception) -> None:
        for ticket in list(self.admission.queue) + list(self.pending):
            self.admission.remove(ticket)
            self._fail_ticket(ticket, err)
        for row in list(self.rows):
            self._fail_row(row, err)
