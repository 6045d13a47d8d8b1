"""Does it matter which threads of a process run torch? A decode step of 16 rows (the engine's own
LlamaRunner) timed on a worker thread that loads the model and decodes, in a fresh process each:
  alone   nothing else in the process ran torch (the inference stage's TorchThread layout)
  after   the main thread ran one parallel op first (the layout before TorchThread: the model was
          loaded and warmed on one thread, the batching loop ran on another)

Run: .venv/bin/python -m bench.probes.torch_thread [--steps 15]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.modelfile import source as model_source

ROOT = Path(__file__).resolve().parents[2]


def child(dtype: str, case: str, steps: int) -> None:
    import torch

    from services.inference.model.forward import LlamaRunner
    from services.inference.model.loader import load_model
    torch.set_num_threads(2)
    if case == "after":
        float((torch.randn(4_000_000) * 2).sum())  # one parallel region on the main thread

    def work() -> None:
        runner = LlamaRunner(load_model(model_source().cache_dir, dtype))
        caches = [runner.new_cache(64 + steps) for _ in range(16)]
        for c in caches:
            runner.prefill(list(range(10, 50)), c)
        for _ in range(3):
            runner.decode([5] * 16, caches)
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.decode([5] * 16, caches)
        print((time.perf_counter() - t0) / steps * 1e3)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--child", nargs=2, metavar=("DTYPE", "CASE"))
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.steps)
        return 0
    from bench.bench_inference import machine
    print(f"Machine: {machine()}\n\n| dtype | alone, ms per step | after, ms per step | after / alone "
          "|\n|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        ms = {}
        for case in ("alone", "after"):
            argv = [sys.executable, "-m", __spec__.name, "--child", dtype, case, "--steps", str(args.steps)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            ms[case] = float(out.strip().splitlines()[-1])
        print(f"| {dtype} | {ms['alone']:.1f} | {ms['after']:.1f} | {ms['after'] / ms['alone']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
