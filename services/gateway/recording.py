"""Replay records and feedback: the gateway's side of the feedback stage (services/feedback).

``ReplayRecorder.served`` is called at the end of every answered request. It only appends to a
bounded in-memory queue (never blocks, never raises): a worker task turns queued answers into
``ReplayRecord`` messages and sends them in batches to the feedback stage, off the request path.
A full queue or a feedback stage that stays unreachable drops records, each counted in
``keel_replay_records_dropped_total{reason}``; the answer itself is never affected. (Durability
once a record reached the feedback stage is that stage's job: it spills while its database is down.)

``FeedbackForwarder.submit`` carries a client's SubmitFeedback to the feedback stage, coalesced
with the other calls in flight into batches (services/gateway/submits.py), sent on one
long-lived SubmitStream call (services/gateway/submitstream.py). A client
may send feedback right after its answer, before the record left this gateway's queue: submit
first waits (briefly) for that trace's record to be delivered, so it is not NOT_FOUND by a race.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from keel.common.v1 import common_pb2
from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from services.gateway.contract import Ask
from services.gateway.submits import SubmitCoalescer
from services.gateway.submitstream import SubmitStream
from services.gateway.tools import TurnTools
from services.gateway.values import Served
from shared import client, errors, metrics
from shared.controls import format_pb, sampling_pb

log = logging.getLogger("keel.gateway")


@dataclass(frozen=True)
class ReplayConfig:
    enabled: bool = True
    queue_size: int = 10000        # answers waiting to be sent; beyond it records are dropped
    batch: int = 64                # records per Record call
    send_timeout_ms: int = 2000
    attempts: int = 5              # per batch, 100 ms apart doubling, before it is dropped
    feedback_wait_ms: int = 2000   # SubmitFeedback waits this long for its trace's record to be sent
    submit_batch: int = 64         # SubmitFeedback items per batch sent to the feedback stage
    submit_inflight: int = 1       # batches on the wire at once; items arriving meanwhile form the next
    submit_stream_age_s: float = 60.0  # the batches' SubmitStream call is replaced once this old


def _messages(a: Ask) -> list[common_pb2.ChatMessage]:
    turns = a.turn_tools or (TurnTools(),) * len(a.messages)
    return [common_pb2.ChatMessage(role=r, content=c, tool_calls=[x.pb() for x in t.calls], tool_call_id=t.call_id)
            for (r, c), t in zip(a.messages, turns)]


def to_record(s: Served, created_ms: int) -> feedback_pb2.ReplayRecord:
    """The record of an answer: the input as the client sent it (a replay sends it again, and the
    gateway renders a request's tools into it again), the sampling as applied, the prompt and output
    ids as the model saw and made them, and the answer's tool calls."""
    a, sent = s.ask, s.sent or s.ask
    box = sent.tools
    rec = feedback_pb2.ReplayRecord(
        trace_id=s.trace_id, created_unix_ms=created_ms, prompt_ids=s.encoded.ids,
        messages=_messages(sent), text=sent.text or "", sampling=sampling_pb(a.sampling(s.done.seed)),
        domain=a.domain, source=a.source, output_ids=s.output_ids, finish_reason=s.done.finish_reason,
        validation=s.validation, engine=s.done.engine, input_fingerprint=s.encoded.fingerprint,
        vocab_sha256=s.encoded.vocab_sha256, chat_template_sha256=s.encoded.chat_template_sha256,
        adapter=s.done.adapter, response_format=format_pb(sent.controls.response_format),
        tool_calls=[c.pb() for c in s.tool_calls],
        route=None if s.done.route is None else feedback_pb2.RouteDecision(
            replica=s.done.route.replica, policy=s.done.route.policy, reason=s.done.route.reason,
            matched_blocks=s.done.route.matched_blocks))
    if box is not None:
        rec.tools.extend(common_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters,
                                         strict=t.strict) for t in box.tools)
        rec.tool_choice.CopyFrom(common_pb2.ToolChoice(mode=box.mode, function=box.function))
        rec.parallel_tool_calls = box.parallel
    return rec


def _channel(targets: tuple[str, ...], max_message_bytes: int) -> grpc.aio.Channel:
    # Several replicas: one channel balancing round robin over their addresses (IP:port).
    target = targets[0] if len(targets) == 1 else "ipv4:" + ",".join(targets)
    return client.channel(target, max_message_bytes=max_message_bytes)


class LazyStub:
    """The feedback stage's stub, made on first use: a grpc.aio channel must be created inside the
    event loop that uses it, and the stage is assembled before the loop runs."""

    def __init__(self, targets: tuple[str, ...], max_message_bytes: int):
        self._targets, self._max = targets, max_message_bytes
        self._stub: feedback_pb2_grpc.FeedbackStub | None = None

    def __call__(self) -> feedback_pb2_grpc.FeedbackStub:
        if self._stub is None:
            self._stub = feedback_pb2_grpc.FeedbackStub(_channel(self._targets, self._max))
        return self._stub


class ReplayRecorder:
    def __init__(self, cfg: ReplayConfig, stub: Callable[[], feedback_pb2_grpc.FeedbackStub]):
        self.cfg, self._stub = cfg, stub
        self._queue: asyncio.Queue[tuple[Served, int]] = asyncio.Queue(cfg.queue_size)
        self._pending: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self._dropped = metrics.metrics_for("gateway").counter("keel_replay_records_dropped_total")
        for reason in ("queue_full", "unreachable", "error"):
            self._dropped.labels(reason=reason)

    def served(self, s: Served) -> None:
        try:
            self._queue.put_nowait((s, int(time.time() * 1000)))
        except asyncio.QueueFull:
            self._dropped.labels(reason="queue_full").inc()
            return
        self._pending[s.trace_id] = asyncio.Event()

    async def delivered(self, trace_id: str, timeout_s: float) -> None:
        """Wait until this gateway sent the trace's record (or gave up on it); at most ``timeout_s``."""
        event = self._pending.get(trace_id)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Send what is queued (within the send timeout), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self._queue.join(), self.cfg.send_timeout_ms / 1000)
            except TimeoutError:
                log.warning("replay records left unsent at shutdown", extra={"records": self._queue.qsize()})
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.cfg.batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._send([to_record(s, t) for s, t in batch])
            except Exception:  # noqa: BLE001 - a dead worker would silently stop all recording
                log.exception("replay records dropped", extra={"records": len(batch)})
                self._dropped.labels(reason="error").inc(len(batch))
            finally:
                for s, _ in batch:
                    event = self._pending.pop(s.trace_id, None)
                    if event is not None:
                        event.set()
                    self._queue.task_done()

    async def _send(self, records: list[feedback_pb2.ReplayRecord]) -> None:
        request = feedback_pb2.RecordRequest(records=records)
        delay = 0.1
        for attempt in range(self.cfg.attempts):
            try:
                await self._stub().Record(request, timeout=self.cfg.send_timeout_ms / 1000,
                                        metadata=client.mesh_metadata())
                return
            except grpc.aio.AioRpcError as exc:
                err = client.translate(exc)
                if attempt + 1 == self.cfg.attempts:
                    log.error("replay records dropped: feedback stage unreachable",
                              extra={"records": len(records), "error": str(err)})
                    self._dropped.labels(reason="unreachable").inc(len(records))
                    return
                await asyncio.sleep(delay)
                delay *= 2


class FeedbackForwarder:
    def __init__(self, stub: Callable[[], feedback_pb2_grpc.FeedbackStub], recorder: ReplayRecorder):
        self._recorder = recorder
        self._stream = SubmitStream(stub, max_age_s=recorder.cfg.submit_stream_age_s)
        self._batches = SubmitCoalescer(self._stream.send, max_batch=recorder.cfg.submit_batch,
                                        max_inflight=recorder.cfg.submit_inflight)

    async def submit(self, item: feedback_pb2.SubmitRequest, timeout_s: float) -> feedback_pb2.SubmitResult:
        started = time.monotonic()
        await self._recorder.delivered(item.trace_id,
                                       min(timeout_s, self._recorder.cfg.feedback_wait_ms / 1000))
        return await self._batches.submit(item, max(0.001, timeout_s - (time.monotonic() - started)))

    async def close(self) -> None:
        await self._batches.close()
        await self._stream.close()


class FeedbackDisabled:
    """Stands in for the forwarder when no feedback stage is configured."""

    async def submit(self, item: feedback_pb2.SubmitRequest, timeout_s: float) -> feedback_pb2.SubmitResult:
        raise errors.PreconditionFailed("this gateway has no feedback stage configured (upstreams.feedback)",
                                        reason="FEEDBACK_DISABLED")

    async def close(self) -> None:
        pass


def build(targets: tuple[str, ...], cfg: ReplayConfig,
          max_message_bytes: int) -> tuple[ReplayRecorder | None, FeedbackForwarder | FeedbackDisabled]:
    """The recorder (None when records are off) and the forwarder for the configured feedback stage."""
    if not targets:
        return None, FeedbackDisabled()
    stub = LazyStub(targets, max_message_bytes)
    recorder = ReplayRecorder(cfg, stub)
    return (recorder if cfg.enabled else None), FeedbackForwarder(stub, recorder)
