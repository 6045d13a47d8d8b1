"""Inference servicer: protobuf <-> domain conversion; the Engine schedules and runs the model.

Cancellation is structural: when the client goes away or its deadline passes, grpc cancels this
handler, the ``async for`` over the engine's generator is abandoned, and the engine removes the
row from the batch and frees its cache at once.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from opentelemetry import trace

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference.engine.controls import TokenLogprobs
from services.inference.engine.core import Engine, Finished, GenerationRequest, TokenEvent
from shared import errors, tracing
from shared.controls import controls_of
from shared.failures import REPORTABLE

BASE_LABEL = "base"  # the adapter label of requests served by the base model
# WatchCache: block changes a stream may fall behind by before the engine resyncs it with a snapshot,
# and the least time between two load messages (a change of load waits that long at most).
WATCH_CAPACITY = 8192
LOAD_EVERY_S = 0.1


def to_request(req: inference_pb2.GenerateRequest, deadline: float | None) -> GenerationRequest:
    """The engine checks what it alone knows (token ids against its vocabulary, the context window,
    memory); the client contract's ranges (max_tokens, temperature, ...) are the gateway's."""
    s = req.sampling
    if not req.prompt_ids:
        raise errors.InvalidInput("prompt_ids is empty", reason="EMPTY_PROMPT")
    if req.HasField("faults"):  # a deprecated field: fault injection lives in the engine's tests only
        raise errors.PermissionDenied("fault injection is not served by this stage", reason="FAULT_INJECTION_DISABLED",
                                      metadata={"field": "faults"})
    return GenerationRequest(
        request_id=uuid.uuid4().hex, prompt_ids=list(req.prompt_ids), max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop_token_ids=tuple(req.stop_token_ids),
        deadline=deadline, trace_id=tracing.current_trace_id(), fingerprint=req.input_fingerprint,
        adapter=req.adapter, controls=controls_of(s, req.response_format if req.HasField("response_format") else None))


def logprobs_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token=lp.token, token_id=lp.token_id, logprob=lp.logprob, top_logprobs=[
        common_pb2.TopLogprob(token=a.token, token_id=a.token_id, logprob=a.logprob) for a in lp.top])


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine, metrics, facts: dict[str, dict[str, str]] | None = None):
        self.engine = engine
        # per weight format, warmcache.serving_facts: what decides an answer besides the request
        # (Finished.engine of a reply served in that format)
        self.facts = facts or {}
        self._ttft = metrics.histogram("keel_inference_ttft_seconds")
        self._itl = metrics.histogram("keel_inference_itl_seconds")
        self._tokens = metrics.counter("keel_inference_generated_tokens_total")
        self._fallbacks = metrics.counter("keel_inference_precision_fallbacks_total")
        self._fallback_tokens = metrics.counter("keel_inference_fallback_format_tokens_total")
        self._adapter_requests = metrics.counter("keel_inference_adapter_requests_total")
        self._adapter_tokens = metrics.counter("keel_inference_adapter_tokens_total")
        self._draining = asyncio.Event()  # set by end_watches: the WatchCache streams end

    def end_watches(self) -> None:
        """End the WatchCache streams (the stage drains: they would hold the drain to its grace period)."""
        self._draining.set()

    def _phase_spans(self, ev: Finished, start_ns: int, first_ns: int, end_ns: int) -> None:
        """Queue wait, prefill and decode as child spans, from the engine's own timings."""
        tracer = tracing.tracer()
        queued_ns = start_ns + int(ev.queue_ms * 1e6)
        kv = self.engine.memory.kv_bytes_per_token if self.engine.memory else 0
        common = {"format": ev.format, "breaker_level": ev.breaker_level, "inference.variant": ev.variant,
                  "adapter": ev.adapter}
        phases = [("inference.queue", start_ns, queued_ns, {}),
                  ("inference.prefill", queued_ns, first_ns, {"prompt_tokens": ev.prompt_tokens,
                                                              "kv_cache_bytes": kv * ev.prompt_tokens}),
                  ("inference.decode", first_ns, end_ns, {
                      "generated_tokens": ev.completion_tokens,
                      "kv_cache_bytes": kv * (ev.prompt_tokens + ev.completion_tokens),
                      "batch_rows_running_at_finish": self.engine.stats().running_batch_size})]
        for name, t0, t1, attrs in phases:
            span = tracer.start_span(name, start_time=t0, attributes={**common, **attrs,
                                                                      "latency_ms": round((t1 - t0) / 1e6, 3)})
            span.end(end_time=max(t0, t1))

    async def Generate(self, request, context):
        remaining = context.time_remaining()
        start = time.monotonic()
        start_ns = first_ns = time.time_ns()
        req = to_request(request, start + remaining if remaining is not None else None)
        last = start
        span = trace.get_current_span()
        async for ev in self.engine.generate(req):
            now = time.monotonic()
            if isinstance(ev, TokenEvent):
                (self._ttft if ev.index == 0 else self._itl).observe(now - last)
                self._tokens.inc()
                if ev.index == 0:
                    first_ns = time.time_ns()
                last = now
                yield inference_pb2.GenerateEvent(token=inference_pb2.Token(
                    id=ev.token_id, logprob=ev.logprob, entropy=ev.entropy, index=ev.index,
                    logprobs=logprobs_pb(ev.logprobs) if ev.logprobs is not None else None))
            elif isinstance(ev, Finished):
                if ev.format != self.engine.variants[ev.variant]:  # run by the breaker's fallback format
                    self._fallbacks.inc()
                    self._fallback_tokens.inc(ev.completion_tokens)
                span.set_attributes(ev.span_attributes())
                label = ev.adapter or BASE_LABEL
                self._adapter_requests.labels(adapter=label).inc()
                self._adapter_tokens.labels(adapter=label).inc(ev.completion_tokens)
                self._phase_spans(ev, start_ns, first_ns if ev.completion_tokens else time.time_ns(), time.time_ns())
                yield inference_pb2.GenerateEvent(finished=inference_pb2.Finished(
                    finish_reason=ev.finish_reason, seed=ev.seed, queue_ms=ev.queue_ms,
                    breaker_level=ev.breaker_level, engine=self.facts.get(ev.format, {"format": ev.format}),
                    variant=ev.variant, adapter=ev.adapter,
                    prompt_logprobs=[logprobs_pb(lp) for lp in ev.prompt_logprobs],
                    usage=common_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens)))

    async def WatchCache(self, request, context):
        watch = self.engine.watch_cache(WATCH_CAPACITY)
        sent, sent_at = None, 0.0
        try:
            while not self._draining.is_set():
                snapshot, changes = await watch.take(LOAD_EVERY_S)
                if snapshot is not None:
                    yield inference_pb2.CacheEvent(snapshot=inference_pb2.CacheSnapshot(
                        instance_id=self.engine.instance_id, keys=snapshot,
                        block_tokens=self.engine.config.prefill_tokens_per_iteration))
                if changes:
                    yield inference_pb2.CacheEvent(blocks=inference_pb2.CacheBlocks(
                        stored=[k for k, stored in changes.items() if stored],
                        evicted=[k for k, stored in changes.items() if not stored]))
                if time.monotonic() - sent_at < LOAD_EVERY_S:
                    continue
                s = self.engine.stats()
                load = inference_pb2.CacheLoad(running_rows=s.running_batch_size, running_tokens=s.running_tokens,
                                               queued_tokens=s.queued_tokens, free_kv_blocks=s.free_kv_blocks)
                if load != sent:
                    yield inference_pb2.CacheEvent(load=load)
                    sent, sent_at = load, time.monotonic()
        finally:
            watch.close()

    async def ListAdapters(self, request, context):
        table = self.engine.adapters
        return inference_pb2.ListAdaptersResponse(base_fingerprint=table.base_fingerprint, adapters=[
            inference_pb2.AdapterState(id=s.id, version=s.version, state=s.state, reason=s.reason,
                                       detail=s.detail, slot=s.slot) for s in table.states])

    async def ReportFailure(self, request, context):
        if request.kind not in REPORTABLE:
            raise errors.InvalidInput(f"failure kind must be one of {', '.join(REPORTABLE)}",
                                      reason="UNKNOWN_FAILURE_KIND", metadata={"kind": request.kind[:64]})
        self.engine.report_failure(request.kind, request.cause[:200])
        return inference_pb2.ReportFailureResponse()

    async def SetVariant(self, request, context):
        switch = await self.engine.set_variant(request.variant, request.actor[:200])
        return inference_pb2.SetVariantResponse(active=switch.active, previous=switch.previous)

    async def GetVariant(self, request, context):
        return inference_pb2.GetVariantResponse(active=self.engine.active_variant(), variants=self.engine.variants,
                                                locked=sorted(self.engine.locked_variants()))
