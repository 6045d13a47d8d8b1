"""`keel trace TRACE_ID`: one request's spans from every stage's trace files, in time order.

Reads ``var/traces/*.jsonl`` (or KEEL_TRACES_DIR, or --dir) and prints the span tree: start offset,
duration, service, span name, status and attributes.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from shared.tracing import TRACES_DIR


def iter_spans(directory: Path, needle: str, pattern: str = "*.jsonl") -> Iterator[dict]:
    """The spans in ``directory``'s files matching ``pattern`` whose line contains ``needle``
    (a cheap filter before parsing; callers check the field they meant)."""
    for path in sorted(directory.glob(pattern)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if needle in line:
                    yield json.loads(line)


def load_spans(trace_id: str, directory: Path) -> list[dict]:
    spans = [rec for rec in iter_spans(directory, trace_id) if rec.get("trace_id") == trace_id]
    return sorted(spans, key=lambda s: s["start_ns"])


def render(spans: list[dict]) -> str:
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    t0 = spans[0]["start_ns"]
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            attrs = " ".join(f"{k}={v}" for k, v in sorted(s["attributes"].items()))
            status = "" if s["status"] in ("UNSET", "OK") else f" [{s['status']}: {s['status_description']}]"
            lines.append(f"{(s['start_ns'] - t0) / 1e6:9.2f}ms {s['duration_ms']:9.2f}ms  {'  ' * depth}"
                         f"{s['service']}: {s['name']}{status}  {attrs}".rstrip())
            walk(s["span_id"], depth + 1)
    walk("", 0)
    return "\n".join(lines)


def chrome_events(spans: list[dict]) -> dict:
    """Chrome Trace Event JSON (object form) of one trace's spans, for ``--format chrome`` (open the
    file in https://ui.perfetto.dev or chrome://tracing): one process per stage, each span a
    complete ("X") event, overlapping spans of a stage on separate rows; times in microseconds."""
    services = sorted({s["service"] for s in spans})
    pids = {name: i + 1 for i, name in enumerate(services)}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pids[name], "tid": 0, "args": {"name": name}}
                          for name in services]
    lanes: dict[str, list[list[dict]]] = {name: [] for name in services}
    for s in sorted(spans, key=lambda x: (x["start_ns"], -x["end_ns"])):
        events.append({"name": s["name"], "cat": s["service"], "ph": "X", "pid": pids[s["service"]],
                       "tid": _lane(lanes[s["service"]], s) + 1, "ts": s["start_ns"] / 1e3,
                       "dur": (s["end_ns"] - s["start_ns"]) / 1e3,
                       "args": {"span_id": s["span_id"], "parent_id": s["parent_id"], "status": s["status"],
                                **s["attributes"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"trace_id": spans[0]["trace_id"]}}


def _lane(lanes: list[list[dict]], span: dict) -> int:
    """The first row where ``span`` nests inside the open spans (or starts after they end), as
    trace viewers require of complete events on one thread; a new row when none fits."""
    for i, stack in enumerate(lanes):
        while stack and stack[-1]["end_ns"] <= span["start_ns"]:
            stack.pop()
        if not stack or stack[-1]["end_ns"] >= span["end_ns"]:
            stack.append(span)
            return i
    lanes.append([span])
    return len(lanes) - 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="keel trace", description=__doc__.splitlines()[0])
    ap.add_argument("trace_id")
    ap.add_argument("--dir", type=Path, default=TRACES_DIR)
    ap.add_argument("--json", action="store_true", help="print the spans as JSON lines")
    ap.add_argument("--format", choices=("text", "chrome"), default="text",
                    help="chrome: write a Chrome Trace Event file (Perfetto, chrome://tracing)")
    ap.add_argument("--out", type=Path, help="file for --format chrome (default: trace-TRACE_ID.json)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{32}", args.trace_id):
        print("a trace id is 32 lowercase hex characters", file=sys.stderr)
        return 2
    spans = load_spans(args.trace_id, args.dir)
    if not spans:
        print(f"no spans for {args.trace_id} under {args.dir}", file=sys.stderr)
        return 1
    if args.format == "chrome":
        out = args.out or Path(f"trace-{args.trace_id}.json")
        out.write_text(json.dumps(chrome_events(spans)), encoding="utf-8")
        print(f"wrote {len(spans)} spans to {out}")
        return 0
    print("\n".join(json.dumps(s) for s in spans) if args.json else render(spans))
    return 0
