"""Output processing: from one batch's logits to each row's next token and the events it emits.

`OutputProcessor.update(batch, step, policy)` runs the numerical guard, records prompt logprobs,
samples, checks stop and length, and advances each row. It returns the events to deliver and the
rows that ended (finished or failed) for the loop to remove; it never touches the queue or the model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.inference.engine.admission import Ticket
from services.inference.engine.api import Finished, TokenEvent
from services.inference.engine.breaker import BreakerBoard, Policy
from services.inference.engine.controls import Shaped, TokenLogprobs, logprobs, shape
from services.inference.engine.executor import StepOutput
from services.inference.engine.grammar import MaskExecutor
from services.inference.engine.sampling import Draw, Pick, clamp_logits, clamp_temperature, pick, row_is_finite
from services.inference.engine.schedule import Batch, Row
from services.inference.engine.stats import Counters
from shared.errors import Fatal, KeelError, NumericalInstability
from shared.failures import FailureKind

log = logging.getLogger(__name__)


@dataclass
class Update:
    events: list[tuple[Ticket, object]] = field(default_factory=list)  # TokenEvent, Finished or an error
    ended: list[Row] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, eos_token_ids: tuple[int, ...], counters: Counters, board: BreakerBoard,
                 formats: dict[str, str], masks: MaskExecutor):
        self.eos = eos_token_ids
        self.masks = masks
        self.counters = counters
        self.board = board
        self.formats = formats  # runner name -> weight format served

    def update(self, batch: Batch, step: StepOutput, policy: Policy) -> Update:
        out = Update()
        logits = step.logits
        finite = row_is_finite(logits).tolist()
        ready: list[int] = []  # the batch's rows that sample a token this step
        for i, (work, ok) in enumerate(zip(batch.work, finite)):
            row = work.row
            if not ok:
                self._non_finite(row, len(batch.work), out)
                continue
            if work.prefill:
                if step.prompt_scores and row.scores_prompt:
                    row.ticket.controls.score_prompt(work.start, step.prompt_scores[i])
                row.prefilled += len(work.tokens)  # this step's chunk is in the cache now
                if row.prefilling:
                    continue                      # more chunks to go: nothing to sample yet
            ready.append(i)
        if ready:
            rows = [batch.rows[i] for i in ready]
            self._advance(rows, logits if len(ready) == len(batch.rows) else logits[ready], policy, out)
        return out

    def _non_finite(self, row: Row, batch_size: int, out: Update) -> None:
        req = row.ticket.req
        self.counters.numerical_faults += 1
        self.board.record(FailureKind.NUMERICAL_INSTABILITY, f"non-finite logits, request {req.request_id}")
        log.warning("non-finite logits; failing the row", extra={
            "request_id": req.request_id, "trace_id": req.trace_id, "fingerprint": req.fingerprint,
            "step": row.step, "batch_size": batch_size})
        self._fail(row, NumericalInstability(
            "the model produced non-finite logits for this input", reason="NON_FINITE_LOGITS",
            metadata={"request_id": req.request_id, "fingerprint": req.fingerprint, "step": row.step}), out)

    def _advance(self, rows: list[Row], logits: torch.Tensor, policy: Policy, out: Update) -> None:
        """Sample the rows' tokens from their logits [R, V] in one pass; if that pass fails, each row
        again alone (the same bits: every operation is per row), so only a row that fails alone fails."""
        try:
            results = self._sample(rows, logits, policy)
        except Exception:
            results = []
            for r, row in enumerate(rows):
                try:
                    results += self._sample([row], logits[r:r + 1], policy)
                except Exception as exc:
                    req = row.ticket.req
                    log.exception("sampling failed", extra={"request_id": req.request_id, "step": row.step})
                    results.append(Fatal(f"sampling failed: {type(exc).__name__}: {exc}", reason="SAMPLING_FAILED",
                                         metadata={"request_id": req.request_id, "step": row.step}))
        for row, result in zip(rows, results):
            if isinstance(result, Exception):
                self._fail(row, result, out)
                continue
            try:
                ends = row.ticket.controls is not None and row.ticket.controls.accept(result[0].token_id)
            except KeelError as err:  # the row's grammar gave out (its reason says so): this row only
                self._fail(row, err, out)
                continue
            self._emit(row, *result, ends, out)

    def _sample(self, rows: list[Row], logits: torch.Tensor, policy: Policy) -> list[tuple[Pick, TokenLogprobs | None]
                                                                                    | KeelError]:
        ctls = [row.ticket.controls for row in rows]
        temperatures = [clamp_temperature(row.ticket.req.temperature, policy.temperature_cap) for row in rows]
        logits = clamp_logits(logits, policy.logit_clamp)
        shaped = shape(ctls, logits, self.masks) if any(ctls) else Shaped(logits)
        picks = pick(logits, [Draw(t, row.ticket.req.top_p, row.ticket.req.top_k, row.ticket.seed,
                                   len(row.ticket.req.prompt_ids) + row.generated)
                              for row, t in zip(rows, temperatures)], shaped.scores)
        picked = [p.token_id for p in picks]
        lps = logprobs(ctls, shaped.scores, picked, temperatures) if any(ctls) else [None] * len(rows)
        return [shaped.errors.get(r) or (p, lp) for r, (p, lp) in enumerate(zip(picks, lps))]

    def _emit(self, row: Row, p: Pick, logprobs: TokenLogprobs | None, ends: bool, out: Update) -> None:
        req = row.ticket.req
        if row.generated == 0:
            row.first_token_at = time.monotonic()
        row.generated += 1
        row.last_token = p.token_id
        ignore_eos = row.ticket.controls is not None and row.ticket.controls.c.ignore_eos
        if (p.token_id in self.eos and not ignore_eos) or p.token_id in req.stop_token_ids:
            self._finish(row, "stop", out)
            return
        self.counters.tokens += 1
        out.events.append((row.ticket, TokenEvent(p.token_id, p.logprob, p.entropy, row.generated - 1, logprobs)))
        if ends:  # a stop string or a complete grammar: the token that ended it is part of the answer
            self._finish(row, "stop", out, streamed=True)
        elif row.generated >= req.max_tokens:
            self._finish(row, "length", out)

    def _finish(self, row: Row, reason: str, out: Update, streamed: bool = False) -> None:
        """`streamed`: the last token was sent (a "stop" by eos or a stop id is not)."""
        t = row.ticket
        self.counters.completed += 1
        out.ended.append(row)
        out.events.append((t, Finished(
            reason, len(t.req.prompt_ids), row.generated - (1 if reason == "stop" and not streamed else 0), t.seed,
            queue_ms=(row.started - t.submitted) * 1000, ttft_ms=(row.first_token_at - t.submitted) * 1000,
            format=self.formats[row.runner], breaker_level=row.breaker_level, variant=row.variant,
            adapter=t.adapter, prompt_logprobs=tuple(t.controls.scored_prompt) if t.controls is not None else ())))

    def _fail(self, row: Row, err: Exception, out: Update) -> None:
        out.ended.append(row)
        out.events.append((row.ticket, err))
