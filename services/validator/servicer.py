"""Validator servicer: protobuf <-> domain conversion; ValidatorCore does the checking.

Both calls may touch Redis (quarantine, review stream) with a short socket timeout, so they run
in a worker thread and never stall the event loop.
"""
from __future__ import annotations

import asyncio

from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.validator.v1 import validator_pb2, validator_pb2_grpc
from services.validator.core import ValidatorCore
from services.validator.output_pipeline import OutputResult
from shared import tracing


def to_result(r: OutputResult) -> common_pb2.ValidationResult:
    # One verdict per check that ran: the failed ones first, then the passed ones; booleans among
    # the probes travel as 0/1.
    failed = [common_pb2.Verdict(plugin=v.plugin, passed=False, message=v.message, blocking=v.blocking)
              for v in r.verdicts]
    passed = [common_pb2.Verdict(plugin=name, passed=True, blocking=blocking) for name, blocking in r.passed_checks]
    return common_pb2.ValidationResult(
        passed=not r.blocked, low_confidence=r.low_confidence,
        probes={k: float(v) for k, v in r.probes.items()}, verdicts=failed + passed)


class ValidatorServicer(validator_pb2_grpc.ValidatorServicer):
    def __init__(self, core: ValidatorCore, observer):
        self.core, self.observer = core, observer

    async def ValidateInput(self, request, context):
        if request.rejected_reason:
            await asyncio.to_thread(
                self.core.quarantine_rejected, request.payload_json, source=request.source or "default",
                domain=request.domain or "default", trace_id=tracing.current_trace_id(),
                reason=request.rejected_reason, message=request.rejected_message)
        flags, qid = await asyncio.to_thread(
            self.core.validate_input, request.payload_json, source=request.source or "default",
            domain=request.domain or "default", trace_id=tracing.current_trace_id())
        trace.get_current_span().set_attributes({"flags": ",".join(flags), "quarantine_id": qid})
        return validator_pb2.ValidateInputResponse(flags=flags, quarantine_id=qid)

    async def ValidateOutput(self, request, context):
        entropies = list(request.token_entropies)
        result = await asyncio.to_thread(
            self.core.validate_output, request.text, domain=request.domain or "default",
            token_entropies=entropies, prompt=request.prompt, trace_id=tracing.current_trace_id(),
            json_schema=request.json_schema, continuation=request.continuation)
        self.observer(result, len(entropies))
        span = trace.get_current_span()
        span.set_attributes({f"probe.{k}": float(v) for k, v in result.probes.items()})
        span.set_attributes({"verdicts": ",".join(f"{v.plugin}:{'block' if v.blocking else 'note'}"
                                                  for v in result.verdicts) or "all_passed",
                             "blocked": result.blocked, "low_confidence": result.low_confidence})
        return validator_pb2.ValidateOutputResponse(text=result.text, result=to_result(result))
