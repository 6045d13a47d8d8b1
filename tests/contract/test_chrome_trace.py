"""`keel trace ID --format chrome`: a Chrome Trace Event file from the span files."""
from __future__ import annotations

import json

from keelctl import trace

TRACE = "ab" * 16


def span(service, name, sid, parent, start_ms, end_ms, **attrs):
    return {"trace_id": TRACE, "span_id": sid, "parent_id": parent, "service": service, "name": name,
            "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6), "duration_ms": end_ms - start_ms,
            "status": "UNSET", "status_description": "", "attributes": attrs, "events": []}


SPANS = [
    span("gateway", "gateway/Generate", "a1", "", 0, 100),
    span("gateway", "call validator/ValidateInput", "a2", "a1", 1, 30, upstream="validator"),
    span("gateway", "call tokenizer/Encode", "a3", "a1", 2, 35),  # overlaps a2 without nesting in it
    span("validator", "validator/ValidateInput", "b1", "a2", 3, 28),
    span("tokenizer", "tokenizer/Encode", "c1", "a3", 4, 18),
]


def test_writes_a_trace_event_file(tmp_path):
    (tmp_path / "traces").mkdir()
    with open(tmp_path / "traces" / "gateway-1.jsonl", "w") as f:
        for s in SPANS + [dict(SPANS[0], trace_id="cd" * 16)]:
            f.write(json.dumps(s) + "\n")
    out = tmp_path / "t.json"
    assert trace.main([TRACE, "--dir", str(tmp_path / "traces"), "--format", "chrome", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = {e["args"]["name"]: e["pid"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert set(names) == {"gateway", "validator", "tokenizer"}
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(SPANS)
    root = next(e for e in complete if e["name"] == "gateway/Generate")
    assert (root["ts"], root["dur"], root["pid"]) == (0.0, 100_000.0, names["gateway"])
    assert next(e for e in complete if e["name"] == "call validator/ValidateInput")["args"]["upstream"] == "validator"


def test_events_on_one_row_nest_as_trace_viewers_require():
    events = [e for e in trace.chrome_events(SPANS)["traceEvents"] if e["ph"] == "X"]
    rows: dict[tuple, list] = {}
    for e in events:
        rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in rows.values():
        for a0, a1 in intervals:
            for b0, b1 in intervals:
                assert a1 <= b0 or b1 <= a0 or (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
    gateway_rows = {e["tid"] for e in events if e["cat"] == "gateway"}
    assert len(gateway_rows) == 2  # the two overlapping client calls cannot share a row
