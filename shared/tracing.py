"""OpenTelemetry for every stage: W3C traceparent in gRPC metadata, spans as JSON lines on disk.

Spans go to ``var/traces/<service>-<pid>-<YYYYMMDDHH>.jsonl`` (a new file every hour and whenever one
passes ``max_bytes``), always; to OTLP as well when OTEL_EXPORTER_OTLP_ENDPOINT is set.
``keel trace TRACE_ID`` reads every stage's files back (keelctl/trace.py).
"""
from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.config import VAR_DIR

TRACES_DIR = Path(os.environ.get("KEEL_TRACES_DIR", VAR_DIR / "traces"))
_propagator = TraceContextTextMapPropagator()
_getter = DefaultGetter()


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to hourly (and size-capped) JSON-lines files."""

    def __init__(self, directory: Path, service: str, max_bytes: int = 64 * 1024 * 1024):
        self.directory, self.service, self.max_bytes = Path(directory), service, max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = None
        self._hour = ""
        self._part = 0

    def _target(self):
        hour = time.strftime("%Y%m%d%H", time.gmtime())
        if self._file is None or hour != self._hour or self._file.tell() > self.max_bytes:
            if self._file is not None:
                self._file.close()
            self._part = self._part + 1 if hour == self._hour else 0
            self._hour = hour
            suffix = f".{self._part}" if self._part else ""
            name = f"{self.service}-{os.getpid()}-{hour}{suffix}.jsonl"
            self._file = open(self.directory / name, "a", encoding="utf-8")
        return self._file

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            out = self._target()
            for span in spans:
                out.write(json.dumps(span_to_dict(span, self.service), default=str, ensure_ascii=False) + "\n")
            out.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def span_to_dict(span: ReadableSpan, service: str) -> dict:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent else "",
        "service": service,
        "name": span.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "duration_ms": round((span.end_time - span.start_time) / 1e6, 3),
        "status": span.status.status_code.name,
        "status_description": span.status.description or "",
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events],
    }


def setup_tracing(service: str, directory: Path | None = None) -> TracerProvider | None:
    """Install this process's tracer provider. Call once at process start.

    KEEL_TRACING=off installs none (trace ids are then empty): only for measuring tracing's cost.
    """
    if os.environ.get("KEEL_TRACING", "on") == "off":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(
        JsonLinesSpanExporter(directory or TRACES_DIR, service), schedule_delay_millis=200))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


@functools.cache
def tracer(name: str = "keel") -> trace.Tracer:
    """The process's tracer, made once: ``trace.get_tracer`` costs more than starting a span (it
    builds an instrumentation scope and goes through a deprecation shim each time). One made before
    ``setup_tracing`` is the API's proxy, which uses the provider installed later."""
    return trace.get_tracer(name)


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """Context carried by an incoming call's ``traceparent`` (its text metadata as a mapping; an
    empty context if none)."""
    return _propagator.extract(carrier, getter=_getter)


def inject() -> list[tuple[str, str]]:
    """``traceparent`` (and ``tracestate``) metadata for an outgoing call from the current span."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return list(carrier.items())


def current_trace_id() -> str:
    return trace_id_of(trace.get_current_span())


def trace_id_of(span: trace.Span) -> str:
    """``span``'s trace id as 32 hex characters ("" for a span that records nothing)."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else ""
