"""`keel trace TRACE_ID`: one request's spans from every stage's trace files, in time order.

Reads ``var/traces/*.jsonl`` (or KEEL_TRACES_DIR, or --dir) and prints the span tree: start offset,
duration, service, span name, status and attributes.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from shared.tracing import TRACES_DIR


def load_spans(trace_id: str, directory: Path) -> list[dict]:
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if trace_id in line:
                    rec = json.loads(line)
                    if rec.get("trace_id") == trace_id:
                        spans.append(rec)
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="keel trace", description=__doc__.splitlines()[0])
    ap.add_argument("trace_id")
    ap.add_argument("--dir", type=Path, default=TRACES_DIR)
    ap.add_argument("--json", action="store_true", help="print the spans as JSON lines")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{32}", args.trace_id):
        print("a trace id is 32 lowercase hex characters", file=sys.stderr)
        return 2
    spans = load_spans(args.trace_id, args.dir)
    if not spans:
        print(f"no spans for {args.trace_id} under {args.dir}", file=sys.stderr)
        return 1
    print("\n".join(json.dumps(s) for s in spans) if args.json else render(spans))
    return 0
