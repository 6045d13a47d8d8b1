"""Each weight format on the real model, each in a fresh process: RSS after warm-up and decode-pass time.

Per format: load the model in that format, warm an engine up (the stage's defaults from
config/inference.yaml: memory-model probes, batch-invariant sizes), then read the process RSS
(VmRSS and its peak VmHWM from /proc/self/status) and time a decode-like pass (one token per row
through every layer and lm_head, median of 3) at batch 1 and 16, as `auto` does at start.
The row-invariance check (M = 1..17) is the one `auto` uses.

Run: .venv/bin/python -m bench.bench_formats [--formats float32,bfloat16,int8,int4] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from bench.lib.machine import machine_line

ROOT = Path(__file__).resolve().parent.parent


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def one(fmt: str, threads: int) -> dict:
    import torch

    from services.inference import config as inf_config
    from services.inference.engine.core import Engine
    from services.inference.formats.selection import decode_pass_s, invariant_sizes
    from services.inference.model.loader import load_model

    torch.set_num_threads(threads)
    cfg = inf_config.load()
    rss0 = status_kib("VmRSS")
    model = load_model(cfg.model_dir, fmt)
    engine = Engine(model, replace(cfg.engine, format=fmt, intra_op_threads=threads))
    engine.warmup()
    rss = status_kib("VmRSS")
    sizes = invariant_sizes(model)
    return {"format": fmt, "rss_mib": rss / 1024, "hwm_mib": status_kib("VmHWM") / 1024,
            "rss_before_load_mib": rss0 / 1024, "static_mib": engine.memory.static_bytes / 2**20,
            "row_invariant": len(sizes) == 17, "pass_b1_ms": decode_pass_s(model, min(sizes)) * 1e3,
            "pad_b1": min(sizes), "pass_b16_ms": decode_pass_s(model, 16) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.threads)))
        return 0
    rows = []
    for fmt in args.formats.split(","):
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--one", fmt, "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print(f"\nCommand: `.venv/bin/python -m bench.bench_formats {' '.join(argv or sys.argv[1:])}`")
    print(machine_line() + "\n")
    print("| format | RSS after warm-up (MiB) | peak RSS (MiB) | static bytes (MiB) | row-invariant M=1..17 "
          "| decode pass b1 (ms) | decode pass b16 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b1 = f"{r['pass_b1_ms']:.1f}" + (f" (padded to {r['pad_b1']})" if r["pad_b1"] > 1 else "")
        print(f"| {r['format']} | {r['rss_mib']:.0f} | {r['hwm_mib']:.0f} | {r['static_mib']:.0f} | "
              f"{'yes' if r['row_invariant'] else 'no (engine pads)'} | {b1} | {r['pass_b16_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
