"""The step loop: one thread owns the rows, the queue, the counters and the OOM cap, and runs every step.

Each iteration: drain the inbox (submit, cancel, variant switch, a refusal to count, stop sent by other
threads), end cancelled and expired requests, `Scheduler.schedule()` a `StepPlan`, give newcomers a
cache (the `KvManager`: their blocks and the prefix cache's), then for each batch of the plan
`executor.execute(batch)` -> its logits (and prompt scores) and `OutputProcessor.update(batch, step)` -> events. It then
publishes an `EngineStats` snapshot and only after that delivers the iteration's events to the
consumers' asyncio loops. Nothing here is shared with the asyncio side but the inbox (a thread-safe
queue), the tickets' `cancelled` flags and the published snapshot.
"""
from __future__ import annotations

import logging
import queue
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType

from services.inference.engine.admission import Ticket
from services.inference.engine.api import TokenEvent
from services.inference.engine.breaker import BreakerBoard, Policy
from services.inference.engine.cachewatch import CacheWatch
from services.inference.engine.executor import BatchExecutor
from services.inference.engine.inbox import Cancel, Command, Refused, SetVariant, Stop, Submit, Watch
from services.inference.engine.kv import KvManager
from services.inference.engine.memory import MemoryModel, PeakMeter
from services.inference.engine.oom import OomPolicy, is_oom
from services.inference.engine.output import OutputProcessor
from services.inference.engine.prefix import PrefixCache
from services.inference.engine.schedule import Batch, Row, Scheduler, StepPlan, batch_cap
from services.inference.engine.stats import Counters, EngineStats, MemoryStats, Pace
from services.inference.engine.torchthread import TorchThread
from services.inference.engine.variants import PRIMARY, Switch
from shared.errors import DeadlineExpired, Fatal, KeelError, Overloaded
from shared.failures import FailureKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    max_batch_size: int
    memory_audit: bool  # measure every step's allocator peak against the memory model (slow)
    device: str
    variants: Mapping[str, str]    # variant name -> the weight format (runner) it runs on
    breaker_fallback: str | None   # the weight format new requests run on at breaker level 2, if any


class StepLoop:
    def __init__(self, executor: BatchExecutor, scheduler: Scheduler, output: OutputProcessor, board: BreakerBoard,
                 oom: OomPolicy, counters: Counters, memory: MemoryModel, settings: LoopSettings,
                 tokens_per_s: float, prefix: PrefixCache | None = None):
        self.executor = executor
        self.scheduler = scheduler
        self.output = output
        self.board = board
        self.oom = oom
        self.counters = counters
        self.memory = memory
        self.settings = settings
        self.tokens_per_s = tokens_per_s
        self.pace = Pace()  # per-row decode rate, measured by this loop's steps (deadline admission)
        self.kv = KvManager(executor, prefix)
        self.observed_peak_bytes = 0
        self.active = PRIMARY  # the variant new rows start on; changed only by this thread (_switch)
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._outbox: list[tuple[Ticket, object]] = []
        self._stats = EngineStats()
        self._owned_thread: TorchThread | None = None  # made by start() when given none; closed at shutdown
        self._done: Future | None = None
        self._publish()

    # ---- any thread ----
    def start(self, thread: TorchThread | None = None) -> None:
        """Run the loop on the process's torch thread, or on a thread of its own."""
        if thread is None:
            thread = self._owned_thread = TorchThread("keel-inference")
        self._done = thread.submit(self._run)

    def submit(self, ticket: Ticket) -> None:
        self.inbox.put(Submit(ticket))

    def refused(self, err: KeelError) -> None:
        """Count a request the engine refused without submitting it (its counters are this loop's)."""
        self.inbox.put(Refused(err))

    def cancel(self, ticket: Ticket) -> None:
        """Queued: removed at the next iteration. Running: removed (cache freed) before its next step."""
        ticket.cancelled = True
        self.inbox.put(Cancel(ticket))

    def set_variant(self, name: str, actor: str, done: Future) -> None:
        """Make `name` (a known variant) serve the rows created from the next iteration on; `done`
        gets the `Switch` once the loop has applied it and published it in its stats."""
        self.inbox.put(SetVariant(name, actor, done))

    def watch_cache(self, watch: CacheWatch) -> None:
        self.inbox.put(Watch(watch))

    def stats(self) -> EngineStats:
        return self._stats

    def set_memory(self, memory: MemoryModel) -> None:
        """A memory model with more static bytes (adapter slots); only before start()."""
        self.memory = self.scheduler.admission.memory = memory
        self._publish()

    def shutdown(self, error: Exception) -> None:
        """Stop the loop; every request still queued or running gets `error`. Blocks until it has."""
        self.inbox.put(Stop(error))
        if self._done is not None:
            self._done.result()
        if self._owned_thread is not None:
            self._owned_thread.close()

    # ---- the loop thread ----
    def _run(self) -> None:
        wait_s = 0.0
        while True:
            stop = self._drain_inbox(wait_s)
            if stop is not None:
                self._stop(stop)
                return
            policy = self.board.policy()
            self._expire()
            plan = self.scheduler.schedule(policy, self._cap(policy))
            if not plan.admitted and not self.scheduler.rows:
                self._publish()
                self._flush()
                wait_s = self.scheduler.idle_wait()
                continue
            wait_s = 0.0
            self._publish()
            try:
                self._audited_step(plan)
            except Exception as exc:  # a bug must fail the requests involved, not kill the loop
                log.exception("inference step failed", extra={"batch_size": len(self.scheduler.rows)})
                err = Fatal(f"inference step failed: {type(exc).__name__}: {exc}", reason="STEP_FAILED")
                for ticket in plan.admitted:
                    self.scheduler.admission.release(ticket)
                    self._emit(ticket, err)
                for row in list(self.scheduler.rows):
                    self._fail_row(row, err)
            self._publish()
            self._flush()

    def _drain_inbox(self, wait_s: float) -> Exception | None:
        """Apply every message waiting (blocking up to wait_s for the first); returns a stop error if any."""
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return None
        while True:
            match item:
                case Stop(error):
                    return error
                case Submit(ticket):
                    self._admit_or_queue(ticket)
                case SetVariant(name, actor, done):
                    self._switch(name, actor, done)
                case Refused(error):
                    self.counters.fail(error.reason)
                case Cancel(ticket):
                    self.scheduler.cancel(ticket)
                case Watch(watch):
                    self.kv.watch(watch)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return None

    def _admit_or_queue(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            return
        try:
            self.scheduler.submit(ticket, self._cap(self.board.policy()), self._retry_after_ms(), self.pace,
                                  time.monotonic())
        except KeelError as err:
            log.info("request refused", extra={"reason": err.reason, "request_id": ticket.req.request_id,
                                               "detail": err.metadata})
            self._emit(ticket, err)
            return
        self.counters.admitted += 1

    def _switch(self, name: str, actor: str, done: Future) -> None:
        """Between two steps: rows already created keep their runner, new ones take this variant's."""
        switch = Switch(name, self.active)
        self.active = name
        self._publish()
        log.info("active variant switched" if switch.changed else "active variant unchanged", extra={
            "variant": name, "previous": switch.previous, "format": self.settings.variants[name], "actor": actor})
        done.set_result(switch)

    def _expire(self) -> None:
        tickets, rows = self.scheduler.expire(time.monotonic(), self._retry_after_ms(), self.pace)
        for ticket, err in tickets:
            log.info("queued request ended", extra={"reason": err.reason, "request_id": ticket.req.request_id,
                                                    "detail": err.metadata})
            self._emit(ticket, err)
        for row, err in rows:
            if err is None:
                self.scheduler.remove(row)  # cancelled: its consumer is gone or was told already
            else:
                self._fail_row(row, err)

    def _audited_step(self, plan: StepPlan) -> None:
        if not self.settings.memory_audit:
            self._step(plan)
            return
        live = sum(r.cache.nbytes for r in self.scheduler.rows) + self.memory.static_bytes
        live += self.kv.prefix_bytes
        with PeakMeter(self.settings.device) as meter:
            self._step(plan)
        self.observed_peak_bytes = max(self.observed_peak_bytes, live + meter.peak)

    def _step(self, plan: StepPlan) -> None:
        for ticket in plan.admitted:
            self._new_row(ticket, plan.policy)
        rows = [r for r in self.scheduler.rows if not r.ticket.cancelled]
        decoding = sum(1 for r in rows if r.generated)
        t0 = time.monotonic()
        for batch in plan.batches(rows):
            self._execute(batch, plan.policy)
        if decoding:
            step_s = max(time.monotonic() - t0, 1e-6)
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * decoding / step_s
            self.pace = self.pace.after(step_s)
        self.oom.on_step()

    def _new_row(self, ticket: Ticket, policy: Policy) -> None:
        """Give an admitted request its cache (for prompt + max_tokens) and a place in the batch."""
        req = ticket.req
        # A request with an adapter runs on the primary format, the one its adapter was checked against
        # at start (lora/startup.py): neither a variant switch nor the breaker's fallback format moves it.
        variant = PRIMARY if ticket.slot else self.active
        fallback = self.settings.breaker_fallback if policy.use_fallback and not ticket.slot else None
        name = fallback or self.settings.variants[variant]
        try:
            cache = self.kv.new_cache(name, req.total_tokens)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._on_oom(exc, 1)
            self.scheduler.admission.release(ticket)
            self._emit(ticket, self._oom_error(req.request_id))
            return
        row = Row(ticket, name, cache, time.monotonic(), policy.level,
                  chunk_tokens=self.scheduler.prefill_tokens, variant=variant)
        self.kv.adopt_prefix(row)
        self.scheduler.add(row)

    def _execute(self, batch: Batch, policy: Policy) -> None:
        """Run one batch; on OOM retry it in halves (nothing was committed), a single row fails alone."""
        try:
            step = self.executor.execute(batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            rows = batch.rows
            self._on_oom(exc, len(rows))
            if len(rows) == 1:
                self._fail_row(rows[0], self._oom_error(rows[0].ticket.req.request_id))
                return
            self.counters.oom_recoveries += 1
            half = len(rows) // 2
            self._execute(Batch(batch.runner, batch.work[:half]), policy)
            self._execute(Batch(batch.runner, batch.work[half:]), policy)
            return
        chunks = [(w.row, w.start, len(w.tokens)) for w in batch.work if w.prefill]
        update = self.output.update(batch, step, policy)
        if chunks:
            self.kv.keep_prefix_blocks(chunks)
        for row in update.ended:
            self.scheduler.remove(row)  # before the consumer hears of it: an ended row has left the batch
        for ticket, item in update.events:
            self._emit(ticket, item)

    def _emit(self, ticket: Ticket, item: object) -> None:
        """Queue an event for delivery after this iteration's stats are published; count failures once."""
        if ticket.ended:
            return
        if not isinstance(item, TokenEvent):
            ticket.ended = True
        if isinstance(item, Exception):
            self.counters.fail(getattr(item, "reason", type(item).__name__))
            if isinstance(item, DeadlineExpired):
                self.board.record(FailureKind.TIMEOUT, item.reason)
        self._outbox.append((ticket, item))

    def _flush(self) -> None:
        for ticket, item in self._outbox:
            ticket.send(item)
        self._outbox.clear()

    def _fail_row(self, row: Row, err: Exception) -> None:
        self.scheduler.remove(row)
        self._emit(row.ticket, err)

    def _on_oom(self, exc: BaseException, batch: int) -> None:
        self.counters.oom_events += 1
        self.board.record(FailureKind.OOM, f"{type(exc).__name__} at batch {batch}")
        self.oom.on_oom(exc, batch)

    def _oom_error(self, request_id: str) -> Overloaded:
        return Overloaded("out of memory even at batch size 1", reason="OUT_OF_MEMORY",
                          retry_after_ms=self._retry_after_ms(), metadata={"request_id": request_id})

    def _cap(self, policy: Policy) -> int:
        return batch_cap(self.settings.max_batch_size, policy, self.oom.cap)

    def _retry_after_ms(self) -> int:
        return self.scheduler.retry_after_ms(self.tokens_per_s)

    def _stop(self, err: Exception) -> None:
        for ticket in self.scheduler.drain_all():
            self._emit(ticket, err)
        while True:  # submissions that raced the stop
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            match item:
                case Submit(ticket):
                    self._emit(ticket, err)
                case SetVariant(done=done):
                    done.set_exception(err)
        self._publish()
        self._flush()

    def _publish(self) -> None:
        adm = self.scheduler.admission
        self._stats = EngineStats(
            queue_depth=len(adm.queue), queued_tokens=adm.queued_tokens, retry_after_ms=self._retry_after_ms(),
            running_batch_size=len(self.scheduler.rows), pending_prefill=len(self.scheduler.pending),
            running_tokens=sum(r.ticket.req.total_tokens for r in self.scheduler.rows),
            free_kv_blocks=adm.pool_blocks - adm.reserved_blocks,
            oom_cap=self.oom.cap,
            memory=MemoryStats(self.memory, adm.budget, adm.predicted_bytes, self.observed_peak_bytes or None),
            invariant_batch_sizes=MappingProxyType({k: r.invariant_sizes for k, r in self.executor.runners.items()}),
            tokens_per_s=round(self.tokens_per_s, 2), pace=self.pace,
            ahead_tokens=self.scheduler.ahead_tokens(self._cap(self.board.policy())), counters=self.counters.snapshot(),
            prefix_cache=self.kv.prefix_stats(),
            active_variant=self.active)
