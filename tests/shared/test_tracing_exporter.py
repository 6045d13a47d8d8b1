"""JsonLinesSpanExporter: one JSON line per span, a new file each hour and whenever one passes max_bytes."""
from __future__ import annotations

import json
import os
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Status, StatusCode

from shared import tracing


class Clock:
    """Stands in for the ``time`` module inside shared.tracing: the hour is whatever the test sets."""

    def __init__(self, hour: str):
        self.hour = hour

    def gmtime(self):
        return None

    def strftime(self, fmt, _t):
        assert fmt == "%Y%m%d%H"
        return self.hour


@pytest.fixture
def clock(monkeypatch):
    c = Clock("2026120108")
    monkeypatch.setattr(tracing, "time", c)
    return c


def exporting(tmp_path, max_bytes):
    exporter = tracing.JsonLinesSpanExporter(tmp_path, "svc", max_bytes=max_bytes)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def span(name: str):
        with tracer.start_as_current_span(name):
            pass
    return exporter, span


def lines(path) -> list[str]:
    return [json.loads(line)["name"] for line in path.read_text().splitlines()]


def test_a_file_past_max_bytes_is_followed_by_numbered_parts(tmp_path, clock):
    exporter, span = exporting(tmp_path, max_bytes=1)
    for name in ("a", "b", "c"):
        span(name)
    exporter.shutdown()
    base = f"svc-{os.getpid()}-2026120108"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{base}.1.jsonl", f"{base}.2.jsonl", f"{base}.jsonl"]
    assert [lines(tmp_path / f"{base}{s}.jsonl") for s in ("", ".1", ".2")] == [["a"], ["b"], ["c"]]


def test_spans_share_a_file_until_it_passes_max_bytes(tmp_path, clock):
    exporter, span = exporting(tmp_path, max_bytes=10_000)
    for name in ("a", "b", "c"):
        span(name)
    exporter.shutdown()
    (only,) = tmp_path.iterdir()
    assert lines(only) == ["a", "b", "c"]


def test_a_new_hour_starts_a_new_file_and_numbering_restarts(tmp_path, clock):
    exporter, span = exporting(tmp_path, max_bytes=1)
    span("a")
    span("b")  # part .1 of hour 08
    clock.hour = "2026120109"
    span("c")
    span("d")
    exporter.shutdown()
    pid = os.getpid()
    assert lines(tmp_path / f"svc-{pid}-2026120109.jsonl") == ["c"]
    assert lines(tmp_path / f"svc-{pid}-2026120109.1.jsonl") == ["d"]
    assert len(list(tmp_path.iterdir())) == 4


def test_a_span_line_carries_ids_parent_status_and_attributes(tmp_path, clock):
    exporter = tracing.JsonLinesSpanExporter(tmp_path, "svc")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer") as outer:
        with tracer.start_as_current_span("inner", attributes={"k": "v"}) as inner:
            inner.set_status(Status(StatusCode.ERROR, "boom"))
            inner.add_event("ev", {"n": 1})
    exporter.shutdown()
    (path,) = tmp_path.iterdir()
    inner_d, outer_d = [json.loads(line) for line in path.read_text().splitlines()]
    assert inner_d["parent_id"] == outer_d["span_id"] == f"{outer.get_span_context().span_id:016x}"
    assert outer_d["parent_id"] == "" and inner_d["trace_id"] == outer_d["trace_id"]
    assert inner_d["status"] == "ERROR" and inner_d["status_description"] == "boom"
    assert inner_d["attributes"] == {"k": "v"} and inner_d["events"][0]["name"] == "ev"
    assert inner_d["service"] == "svc" and inner_d["duration_ms"] >= 0


def test_the_hour_comes_from_utc(tmp_path):
    exporter = tracing.JsonLinesSpanExporter(tmp_path, "svc")
    before = time.strftime("%Y%m%d%H", time.gmtime())
    exporter.export([])
    after = time.strftime("%Y%m%d%H", time.gmtime())
    exporter.shutdown()
    (path,) = tmp_path.iterdir()
    assert path.name in (f"svc-{os.getpid()}-{before}.jsonl", f"svc-{os.getpid()}-{after}.jsonl")
