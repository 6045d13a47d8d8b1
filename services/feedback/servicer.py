"""Feedback servicer: protobuf <-> domain conversion only; the writer and the store do the work."""
from __future__ import annotations

import asyncio

from google.protobuf import json_format

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from services.feedback.records import Feedback


def record_from_proto(r: feedback_pb2.ReplayRecord) -> dict:
    """A replay record as a plain dict (the shape services/feedback/records.py stores)."""
    s = r.sampling
    v = r.validation
    return {"trace_id": r.trace_id, "created_ms": r.created_unix_ms, "prompt_ids": list(r.prompt_ids),
            "messages": [{"role": m.role, "content": m.content} for m in r.messages],
            "sampling": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                         "top_k": s.top_k, "seed": s.seed},
            "domain": r.domain, "source": r.source, "output_ids": list(r.output_ids),
            "finish_reason": r.finish_reason, "engine": dict(r.engine), "input_fingerprint": r.input_fingerprint,
            "adapter": r.adapter,
            "validation": json_format.MessageToDict(v, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True)}


def feedback_from_proto(f: feedback_pb2.SubmitRequest) -> Feedback:
    return Feedback(trace_id=f.trace_id, feedback_id=f.feedback_id, error_type=f.error_type, severity=f.severity,
                    expected_keywords=tuple(f.expected_keywords), comment=f.comment)


class FeedbackServicer(feedback_pb2_grpc.FeedbackServicer):
    def __init__(self, core):
        self.core = core  # services.feedback.server.FeedbackCore

    async def Record(self, request, context):
        stored, spilled = await asyncio.to_thread(self.core.record, [record_from_proto(r) for r in request.records])
        return feedback_pb2.RecordResponse(stored=stored, spilled=spilled)

    async def Submit(self, request, context):
        fb = feedback_from_proto(request)
        created = await asyncio.to_thread(self.core.submit, fb)
        return feedback_pb2.SubmitResponse(feedback_id=fb.feedback_id, created=created)
