"""Rejected inputs the validator could not take in time: spilled to disk, sent again until it has.

The gateway hands every input it rejects by its own limits to the validator's quarantine before it
answers (``Pipeline._quarantine``). When that call fails (the validator slower than what is left of
the call's deadline, unreachable, restarting), :meth:`RejectSpill.put` appends the record to an
fsync'd spill file (:class:`shared.spill.SpillLog`) before the rejection is answered, and one task
on the gateway's event loop sends the spilled records to the validator again, oldest first, every
``retry_interval_s`` until the validator echoes each rejection (its answer that it stored the
record: Redis being down is the validator's own spill's business). So no rejected input is dropped.

Delivery is at least once: a call that failed on our side may have reached the validator, whose
flood gate then drops the repeat as a duplicate of the same payload (services/validator/flood.py).
Each resend runs under a span of the rejected request's trace, so the quarantine record names it.
A gateway that stops with a backlog keeps it on disk; the next process to claim that slot (the
restarted worker) sends it. The appends and the cursor's fsyncs run on the event loop: they happen
only while the validator fails, and cost a disk flush each.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from shared import errors, tracing
from shared.config import var_dir
from shared.spill import SpillLog, claim_slot

log = logging.getLogger("keel.gateway")


@dataclass(frozen=True)
class RejectSpillConfig:
    spill_path: str = ""          # "" = <var>/gateway/rejected.spill
    spill_slots: int = 8          # worker processes each claim one: spill_path, spill_path.1, ...
    retry_interval_s: float = 1.0
    send_timeout_ms: int = 2000   # one resend's deadline

    def path(self) -> Path:
        return Path(self.spill_path) if self.spill_path else var_dir() / "gateway" / "rejected.spill"


@dataclass(frozen=True)
class Rejected:
    """One rejected input as the validator's quarantine takes it (a spill line)."""
    payload: dict
    source: str
    domain: str
    reason: str
    message: str
    trace_id: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Rejected:
        return cls(**json.loads(line))


# Hands one record to the validator's quarantine within `timeout` seconds: returns once the validator
# echoed the rejection (stored), raises KeelError otherwise.
Send = Callable[[Rejected, float], Awaitable[None]]


def sender(validate_input) -> Send:
    """The resend over the pipeline's ``Upstreams.validate_input``: the validator answers a record
    handed over as rejected with that same rejection once it stored it."""
    async def send(record: Rejected, timeout: float) -> None:
        try:
            await validate_input(record.payload, record.source, record.domain, timeout, {},
                                 rejected=errors.InvalidInput(record.message, reason=record.reason))
        except errors.InvalidInput:
            return
        raise errors.Fatal("the validator answered a rejected input as accepted (not quarantined)")
    return send


class RejectSpill:
    """``on_backlog(n)`` hears the backlog whenever it changes and every ``retry_interval_s``
    (the gateway exports it: keel_gateway_rejected_spill_backlog)."""

    def __init__(self, cfg: RejectSpillConfig, send: Send, on_backlog: Callable[[int], None] = lambda n: None):
        self.cfg, self._send, self._on_backlog = cfg, send, on_backlog
        self._spill: SpillLog | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Claim a spill slot and start resending (on the running loop); a backlog left by an
        earlier process is sent first."""
        self._spill = claim_slot(self.cfg.path(), self.cfg.spill_slots)
        if self._spill.pending:
            log.warning("rejected inputs wait in the spill", extra={"backlog": self._spill.pending,
                                                                      "spill": str(self._spill.path)})
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._spill is not None:
            self._spill.close()

    def backlog(self) -> int:
        """Records spilled and not yet taken by the validator."""
        return self._spill.pending if self._spill is not None else 0

    def put(self, record: Rejected) -> None:
        """Durable once it returns (fsync'd); the resend task is woken."""
        self._spill.append(record.to_json())
        self._on_backlog(self._spill.pending)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel (close())
            # that arrives just as the event is set.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.retry_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._spill.pending:
                try:
                    await self._drain()
                except Exception:  # a dead task would strand the spill
                    log.exception("resending rejected inputs failed; retrying")
            self._on_backlog(self._spill.pending)

    async def _drain(self) -> None:
        """Send the backlog oldest first; stop at the first record the validator does not take
        (the next round starts from it, so the order is kept)."""
        while entries := self._spill.read(1, Rejected.from_json):
            [entry] = entries
            if entry.item is not None:  # a corrupt line was set aside by read(); commit skips it
                try:
                    with tracing.tracer().start_as_current_span("quarantine resend", context=_trace_of(entry.item)):
                        await self._send(entry.item, self.cfg.send_timeout_ms / 1000)
                except errors.KeelError as err:
                    log.warning("validator did not take a spilled rejected input",
                                extra={"reason": err.reason, "backlog": self._spill.pending})
                    return
            self._spill.commit(entries)
            log.info("spilled rejected input quarantined", extra={"trace_id": entry.item and entry.item.trace_id,
                                                                   "backlog": self._spill.pending})


def _trace_of(record: Rejected):
    """The rejected request's trace as the parent context (none when it had no trace id)."""
    if not record.trace_id:
        return None
    return tracing.extract({"traceparent": f"00-{record.trace_id}-{secrets.token_hex(8)}-01"})
