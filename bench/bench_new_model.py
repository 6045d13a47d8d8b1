"""First start of the inference stage on a model it has never seen: process start to SERVING, with no
prepared folder, no stored gate result and no warm record, beside llama.cpp's time to its first token
on the same file in a fresh process.

Each round gives the stage an empty scratch KEEL_VAR_DIR and KEEL_MODELS_DIR, so it prepares the model
(model/modelcache.py), chooses its format (auto: float32 at once, the candidates gated in the
background, which is not waited for) and warms the engine up. The peer, llama-cpp-python on the same
GGUF with 2 threads, is timed from its process start to the first token of a one-token prompt. The page
cache is warm for both (the file was read before).

Run: .venv/bin/python -m bench.bench_new_model [--rounds 3] [--model PATH] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_inference import machine
from bench.bench_restart import free_port, last_warm_line, start, wait_serving
from shared.modelfile import model_path

ROOT = Path(__file__).resolve().parent.parent
PEER = """
import sys, time
t0 = float(sys.argv[2])
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False, seed=0)
next(llm.generate([1], top_k=1, temp=0.0))
print(time.time() - t0)
"""


def stage_round(model: Path, threads: int) -> tuple[float, dict]:
    scratch = Path(tempfile.mkdtemp(prefix="keel-first-start-"))
    port = free_port()
    env = {**os.environ, "KEEL_VAR_DIR": str(scratch / "var"), "KEEL_MODELS_DIR": str(scratch / "models"),
           "KEEL_MODEL": str(model), "KEEL_INFERENCE_SERVER__PORT": str(port),
           "KEEL_INFERENCE_SERVER__METRICS_PORT": str(free_port()),
           "KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": str(threads)}
    log = scratch / "stage.log"
    proc = start(ROOT, env, log)
    try:
        took = wait_serving(port, proc)
        phases = last_warm_line(log).get("phases_s", {})
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return took, phases


def peer_round(model: Path) -> float:
    out = subprocess.run([sys.executable, "-c", PEER, str(model), repr(time.time())], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="default: the served model")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    model = (args.model or model_path()).resolve()
    keel, peer = [], []
    for i in range(args.rounds):
        took, phases = stage_round(model, args.threads)
        keel.append(took)
        peer.append(peer_round(model))
        print(f"round {i + 1}: keel {took:.2f} s to SERVING (phases {phases}); llama.cpp {peer[-1]:.2f} s "
              "to its first token", flush=True)
    k, p = statistics.median(keel), statistics.median(peer)
    print(json.dumps({"model": str(model), "machine": machine(), "keel_median_s": round(k, 2),
                      "llamacpp_median_s": round(p, 2), "ratio": round(k / p, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
