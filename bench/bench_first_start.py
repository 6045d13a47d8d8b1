"""The first start of the whole mesh with `engine.format: auto` and no stored gate results: how soon it
answers, and what one client loses while auto's candidates are gated in the background.

1. fresh: `keel up` (testing/mesh.py: Redis and every stage, the real model, free ports) with an empty
   var/ and formats.gate_at_start on, timed from launch to every stage SERVING and to the first
   answer through the gateway. One client then sends requests back to back (greedy, --tokens each)
   while the inference stage's status says its gate runs ("during"), pauses until the gate has
   ended (the status back to "serving"), and sends the same requests again ("after", on whatever
   format auto then chose). Figure: tokens/s during / after.
2. stored: a second `keel up` on a fresh folder holding only the gate results start 1 stored, timed
   the same way: the peer of start 1, a start that gates nothing.

Run: .venv/bin/python -m bench.bench_first_start [--gate-prompts N] [--requests N] [--tokens N]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.machine import machine_line
from keelctl import ask, startview
from testing.mesh import start_mesh, stop_mesh

GATING = "gating"
PROMPT = "Write a short story about a lighthouse keeper."


def phase(mesh) -> str:
    status = startview.stage_status(f"127.0.0.1:{mesh.ports['inference'][0]}")
    return status.phase if status else "?"


def client_rate(mesh, requests: int, tokens: int) -> float:
    """Tokens per second of one client sending `requests` requests back to back."""
    done, t0 = 0, time.perf_counter()
    for _ in range(requests):
        answer = ask.ask(mesh.gateway, ask.build_request(PROMPT, max_tokens=tokens), timeout_s=300)
        done += answer.usage.completion_tokens
    return done / (time.perf_counter() - t0)


def timed_start(tmp: Path, args) -> dict:
    env = {"KEEL_INFERENCE_FORMATS__GATE_AT_START": "true"}
    if args.gate_prompts:
        env["KEEL_INFERENCE_FORMATS__GATE_PROMPTS"] = str(args.gate_prompts)
    t0 = time.monotonic()
    mesh = start_mesh(tmp, extra_env=env)
    row = {"serving_s": time.monotonic() - t0}
    try:
        ask.ask(mesh.gateway, ask.build_request("What is the capital of France?", max_tokens=16), timeout_s=300)
        row["first_answer_s"] = time.monotonic() - t0
        row["gating_at_first_answer"] = GATING in phase(mesh)
        if row["gating_at_first_answer"]:
            row["during"] = client_rate(mesh, args.requests, args.tokens)
            row["still_gating_after_during"] = GATING in phase(mesh)
            while GATING in phase(mesh):
                if time.monotonic() - t0 > args.limit_s:
                    raise SystemExit(f"the background gate did not end within {args.limit_s:.0f} s")
                time.sleep(1)
            row["gate_ended_s"] = time.monotonic() - t0
            row["after"] = client_rate(mesh, args.requests, args.tokens)
        log = (tmp / "var" / "log")
        lines = [ln for p in log.glob("inference-*.log") for ln in p.read_text().splitlines()]
        row["switch"] = next((ln for ln in lines if "background quality gate:" in ln), "")
    finally:
        stop_mesh(mesh)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate-prompts", type=int, default=None, help="formats.gate_prompts (default: all 200)")
    ap.add_argument("--requests", type=int, default=6, help="requests per client window")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--limit-s", type=float, default=1800)
    args = ap.parse_args(argv)
    fresh, stored = (Path(tempfile.mkdtemp(prefix=f"keel-first-start-{k}-")) for k in ("fresh", "stored"))
    try:
        first = timed_start(fresh, args)
        (stored / "var").mkdir()
        shutil.copytree(fresh / "var" / "gate", stored / "var" / "gate")
        second = timed_start(stored, args)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(stored, ignore_errors=True)
    print(f"\nCommand: `.venv/bin/python -m bench.bench_first_start {' '.join(argv or sys.argv[1:])}`")
    print(machine_line() + "\n")
    print("| start | s to SERVING | s to first answer | gating at first answer | gate ended (s) | "
          "client tok/s during gate | after gate | during / after |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in (("fresh var/ (gate in the background)", first), ("stored gate results", second)):
        ratio = f"{r['during'] / r['after']:.2f}x" if "during" in r else "-"
        print(f"| {label} | {r['serving_s']:.1f} | {r['first_answer_s']:.1f} | {r['gating_at_first_answer']} | "
              f"{r.get('gate_ended_s', 0):.0f} | {r.get('during', 0):.1f} | {r.get('after', 0):.1f} | {ratio} |")
    print(f"\nfirst answer, fresh / stored: {first['first_answer_s'] / second['first_answer_s']:.2f}x")
    print(f"gate still running after the 'during' window: {first.get('still_gating_after_during')}")
    print(f"the stage's verdict: {first['switch'][:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
