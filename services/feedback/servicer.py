"""Feedback servicer: protobuf <-> domain conversion only; the writer and the store do the work."""
from __future__ import annotations

import asyncio
import collections
import json

from google.protobuf import json_format
from opentelemetry import trace

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from services.feedback.batcher import Result
from services.feedback.records import Feedback, ReplayRecord
from services.feedback.rotation import alerts
from services.feedback.rotation.decisions import Decision
from shared import errors, tracing
from shared.controls import Sampling, controls_of


def _dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def tool_use_of(r: feedback_pb2.ReplayRecord) -> dict | None:
    """A record's tool fields as one JSON object (None: a request without tools): tools, tool_choice,
    parallel_tool_calls, the answer's tool_calls, and per turn index ("0", "1", ...) that turn's
    tool_calls and tool_call_id."""
    turns = {str(i): {"tool_calls": [_dict(c) for c in m.tool_calls], "tool_call_id": m.tool_call_id}
             for i, m in enumerate(r.messages) if m.tool_calls or m.tool_call_id}
    if not (r.tools or r.HasField("tool_choice") or r.tool_calls or turns):
        return None
    use = {"tools": [_dict(t) for t in r.tools], "tool_calls": [_dict(c) for c in r.tool_calls], "turns": turns}
    if r.HasField("tool_choice"):
        use["tool_choice"] = _dict(r.tool_choice)
    if r.HasField("parallel_tool_calls"):
        use["parallel_tool_calls"] = r.parallel_tool_calls
    return use


def record_from_proto(r: feedback_pb2.ReplayRecord) -> ReplayRecord:
    s = r.sampling
    fmt = r.response_format if r.HasField("response_format") else None
    return ReplayRecord(
        trace_id=r.trace_id, created_ms=r.created_unix_ms, messages=tuple((m.role, m.content) for m in r.messages),
        text=r.text or None, tool_use=tool_use_of(r),
        prompt_ids=tuple(r.prompt_ids), output_ids=tuple(r.output_ids),
        sampling=Sampling(s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, controls_of(s, fmt)),
        domain=r.domain, source=r.source, finish_reason=r.finish_reason, engine=dict(r.engine),
        input_fingerprint=r.input_fingerprint, vocab_sha256=r.vocab_sha256,
        chat_template_sha256=r.chat_template_sha256, adapter=r.adapter,
        validation=json_format.MessageToDict(r.validation, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True),
        route={} if not r.HasField("route") else {"replica": r.route.replica, "policy": r.route.policy,
                                                   "reason": r.route.reason, "matched_blocks": r.route.matched_blocks})


def feedback_from_proto(f: feedback_pb2.SubmitRequest) -> Feedback:
    return Feedback(trace_id=f.trace_id, feedback_id=f.feedback_id, error_type=f.error_type, severity=f.severity,
                    expected_keywords=tuple(f.expected_keywords), comment=f.comment)


def result_to_proto(fb: Feedback, result: Result) -> feedback_pb2.SubmitResult:
    if not isinstance(result, errors.KeelError):
        return feedback_pb2.SubmitResult(feedback_id=fb.feedback_id, created=result)
    return feedback_pb2.SubmitResult(feedback_id=fb.feedback_id, error=feedback_pb2.SubmitItemError(
        code=result.code, reason=result.reason, message=result.message, metadata=result.metadata,
        retry_after_ms=result.retry_after_ms))


def decision_to_proto(d: Decision) -> feedback_pb2.RotationDecision:
    return feedback_pb2.RotationDecision(
        id=d.id, rule=d.rule, action=d.action, phase=d.phase, mode=d.mode, outcome=d.outcome,
        detail=d.detail, actor=d.actor, labels=d.labels, snapshot=d.snapshot,
        result_json=json.dumps(d.result, sort_keys=True), attempts=d.attempts, reverts=d.reverts or 0,
        created_unix_ms=d.created_ms, updated_unix_ms=d.updated_ms, applied_unix_ms=d.applied_ms or 0,
        fingerprint=d.fingerprint, starts_at=d.starts_at)


def alerts_from_proto(request: feedback_pb2.RotationDryRunRequest) -> list[alerts.Alert]:
    return alerts.from_doc({"version": "4", "alerts": [
        {"status": a.status, "labels": dict(a.labels), "annotations": dict(a.annotations),
         "fingerprint": a.fingerprint, "startsAt": a.starts_at} for a in request.alerts]})


class FeedbackServicer(feedback_pb2_grpc.FeedbackServicer):
    def __init__(self, core, rotation):
        self.core = core  # services.feedback.server.FeedbackCore
        self.rotation = rotation  # services.feedback.rotation.service.Rotation

    async def Record(self, request, context):
        stored, spilled = await asyncio.to_thread(self.core.record, [record_from_proto(r) for r in request.records])
        return feedback_pb2.RecordResponse(stored=stored, spilled=spilled)

    async def Submit(self, request, context):
        fb = feedback_from_proto(request)
        created = await self.core.submits.submit(fb)
        return feedback_pb2.SubmitResponse(feedback_id=fb.feedback_id, created=created)

    async def SubmitBatch(self, request, context):
        items = [feedback_from_proto(f) for f in request.items]
        results = await self.core.submits.submit_many(items)
        return feedback_pb2.SubmitBatchResponse(results=[result_to_proto(fb, r) for fb, r in zip(items, results)])

    async def SubmitStream(self, request_iterator, context):
        # One span per message, a child of the sender's span for that batch: from the message's
        # arrival to its answer (the call's own span lasts as long as the stream).
        spans: collections.deque[trace.Span] = collections.deque()

        async def batches():
            async for request in request_iterator:
                parent = tracing.extract({"traceparent": request.traceparent}) if request.traceparent else None
                spans.append(tracing.tracer().start_span(
                    "feedback/SubmitStream.batch", context=parent, kind=trace.SpanKind.SERVER,
                    attributes={"items": len(request.items)}))
                yield [feedback_from_proto(f) for f in request.items]
        try:
            async for items, results in self.core.submits.answer_stream(batches()):
                spans.popleft().end()
                yield feedback_pb2.SubmitStreamResponse(
                    results=[result_to_proto(fb, r) for fb, r in zip(items, results)])
        finally:
            for span in spans:  # taken, never answered
                span.end()

    async def RotationStatus(self, request, context):
        st = await self.rotation.status()
        return feedback_pb2.RotationStatusResponse(
            mode=st["mode"], webhook_url=st["webhook_url"],
            replicas=[feedback_pb2.ReplicaVariant(**r) for r in st["replicas"]],
            cooldowns=[feedback_pb2.ActionCooldown(**c) for c in st["cooldowns"]],
            proposals=[decision_to_proto(d) for d in st["proposals"]])

    async def RotationHistory(self, request, context):
        decided = await self.rotation.history(request.limit, request.since_unix_ms)
        return feedback_pb2.RotationHistoryResponse(decisions=[decision_to_proto(d) for d in decided])

    async def ApproveDecision(self, request, context):
        d = await self.rotation.executor.approve(request.id, request.actor)
        return feedback_pb2.ApproveDecisionResponse(decision=decision_to_proto(d))

    async def RotationDryRun(self, request, context):
        verdicts = await self.rotation.executor.dry_run(alerts_from_proto(request))
        return feedback_pb2.RotationDryRunResponse(verdicts=[
            feedback_pb2.RotationVerdict(rule=v["rule"], action=v["action"], fingerprint=v["fingerprint"],
                                         would=v["would"]) for v in verdicts])
