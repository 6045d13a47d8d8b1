"""What `engine.dtype: auto` pays at the first start of a fresh install: the quality gate at start.

Three starts of the inference stage alone (`python -m services.inference`, real model, free ports), each
timed from process start to SERVING on grpc.health.v1, in this order:
  1. fresh: an empty KEEL_VAR_DIR, so the stage gates every auto candidate before serving
     (formats.gate_at_start) and stores the results;
  2. stored results: another empty KEEL_VAR_DIR holding only the gate results start 1 stored, so the
     start is cold (measures its calibration) but runs no gate: the peer of start 1;
  3. warm: start 2's folder again, so its warm-start record is reused too.
Each start's "engine warm" log line gives its phases, and start 1's "quality gate run at start" line
the gate's own seconds.

Run: .venv/bin/python bench/bench_first_start.py [--threads N] [--gate-prompts N]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_restart import ROOT, free_port, last_line, start, wait_serving  # noqa: E402


def timed_start(var: Path, args) -> tuple[float, dict, dict]:
    """Seconds to SERVING, the "engine warm" line and the gate-at-start line (empty when none ran)."""
    env = {**os.environ, "KEEL_VAR_DIR": str(var), "KEEL_INFERENCE_SERVER__PORT": str(port := free_port()),
           "KEEL_INFERENCE_SERVER__METRICS_PORT": str(free_port()), "KEEL_INFERENCE_ENGINE__DTYPE": "auto",
           "KEEL_INFERENCE_MODEL_PATH": str(ROOT / "var" / "model")}
    if args.threads:
        env["KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS"] = str(args.threads)
    if args.gate_prompts:
        env["KEEL_INFERENCE_FORMATS__GATE_PROMPTS"] = str(args.gate_prompts)
    log = var / "stage.log"
    t0 = time.monotonic()
    proc = start(ROOT, env, log)
    try:
        took = wait_serving(port, proc, limit_s=args.limit_s)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return took, last_line(log, "engine warm"), last_line(log, "quality gate run at start")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="engine.intra_op_threads (default: the config's)")
    ap.add_argument("--gate-prompts", type=int, default=None, help="formats.gate_prompts (default: all 200)")
    ap.add_argument("--limit-s", type=float, default=600)
    args = ap.parse_args(argv)
    fresh, stored = (Path(tempfile.mkdtemp(prefix=f"keel-first-start-{k}-")) for k in ("fresh", "stored"))
    rows = []
    try:
        rows.append(("fresh var/ (gate at start)", *timed_start(fresh, args)))
        shutil.copytree(fresh / "gate", stored / "gate")
        rows.append(("stored gate results, cold", *timed_start(stored, args)))
        rows.append(("stored gate results, warm record", *timed_start(stored, args)))
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(stored, ignore_errors=True)
    print(f"\nCommand: `.venv/bin/python bench/bench_first_start.py {' '.join(argv or sys.argv[1:])}`")
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| start | s to SERVING | format served | gate at start (s) | gate verdicts | phases (s) |")
    print("|---|---|---|---|---|---|")
    for label, took, warm, gated in rows:
        print(f"| {label} | {took:.1f} | {warm.get('format')} | {gated.get('seconds', '-')} | "
              f"{gated.get('verdicts', '-')} | {warm.get('phases_s')} |")
    print(f"\nfresh / stored results (cold): {rows[0][1] / rows[1][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
