"""Where the inference stage's resident memory (RSS) goes, from start to its first requests, against
the weight file's size plus the KV cache the requests use (issue 40's target: RSS <= 1.3x that).

Two fresh processes, each with an empty scratch KEEL_VAR_DIR (a cold start: warm-up measures):
  1. start-up, in process: bootstrap.start_engine and the grammar vocabulary as the stage runs them,
     with /proc/self/smaps read before the model loads, after load, after warm-up, after the
     vocabulary is built and after the heap is handed back (bootstrap.trim_heap);
     besides the RSS, its parts: the C heap ([heap] and the threads' arenas cannot be told apart from
     other anonymous memory, so "anonymous" holds both), file mappings (libraries), and, by mincore,
     the KV pools' and the weights' resident bytes.
  2. the stage itself (`python -m services.inference`, gRPC, the same settings): smaps of the process
     once it is SERVING, after its first request (and that request's latency: time to the first token
     and to the last) and after --requests requests, each a prompt of --prompt-tokens ids and exactly
     --max-tokens generated (ignore_eos), one at a time.
The KV the requests use: the largest request's prompt + generated positions (one at a time), in whole
KV blocks, at the runner's bytes per position.

Run: .venv/bin/python -m bench.bench_memory [--model PATH.gguf] [--format gguf] [--requests 2]
     [--prompt-tokens 48] [--max-tokens 32] [--threads 2]
--model: a GGUF served with formats.force (a file of its own has no gate results); default the shipped
model in --format (which must have passed its gate, as the stage requires).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2 ** 20


def smaps(pid: int | str = "self") -> dict[str, int]:
    """Resident bytes of the process by kind of mapping: heap, anonymous (incl. thread arenas and large
    mallocs), files (libraries, mapped files), stack and the rest; total = RSS."""
    parts = {"heap": 0, "anonymous": 0, "files": 0, "other": 0}
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            name = head.group(1)
            kind = ("heap" if name == "[heap]" else "anonymous" if not name
                    else "files" if name.startswith("/") else "other")
        elif line.startswith("Rss:"):
            parts[kind] += int(line.split()[1]) * 1024
    parts["total"] = sum(parts.values())
    return parts


def env_for(args, scratch: Path, port: int | None = None) -> dict[str, str]:
    from bench.bench_restart import free_port

    env = {**os.environ, "KEEL_VAR_DIR": str(scratch / "var"), "KEEL_INFERENCE_ENGINE__FORMAT": args.format,
           "KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "gen")))}
    if args.model:
        env["KEEL_MODEL"] = str(args.model)
        env["KEEL_MODELS_DIR"] = str(scratch / "models")
        env["KEEL_INFERENCE_FORMATS__FORCE"] = "true"
    else:  # the checkout's prepared model and its gate results
        from shared.modelfile import source as model_source
        env["KEEL_MODELS_DIR"] = str(model_source().cache_dir.parent)
        gate = Path(os.environ.get("KEEL_VAR_DIR", ROOT / "var")) / "gate"
        if gate.exists():
            shutil.copytree(gate, scratch / "var" / "gate")
    if port is not None:
        env["KEEL_INFERENCE_SERVER__PORT"] = str(port)
        env["KEEL_INFERENCE_SERVER__METRICS_PORT"] = str(free_port())
    return env


def startup_child() -> None:
    """Part 1, in this (fresh) process: the start-up's points, printed as one JSON line."""
    import services.inference.bootstrap as bootstrap
    from services.inference import config as inf_config
    from services.inference.engine.grammar import Vocabulary
    from services.inference.engine.memory import static_bytes
    from services.inference.model.digest import model_sha256
    from services.inference.server import with_model
    from shared import modelcard, modelfile
    from testing.residency import tensor_resident_bytes

    cfg = with_model(inf_config.load(), modelcard.read(modelfile.source()))
    sha = model_sha256(cfg.model_dir)
    points: dict[str, dict] = {"before load": smaps()}
    models = []
    load = bootstrap.load_model

    def loaded(*a, **k):
        model = load(*a, **k)
        models.append(model)
        points["after load"] = smaps()
        return model

    bootstrap.load_model = loaded  # this process only: the point to read
    started = bootstrap.start_engine(cfg, sha)
    points["after warm-up"] = smaps()
    started.engine.install_vocabulary(Vocabulary(cfg.model_dir / "hf-tokenizer" / "tokenizer.json",
                                                 cfg.engine.eos_token_ids))
    points["after the vocabulary"] = smaps()
    bootstrap.trim_heap()  # as the stage does (server.py)
    points["after trim"] = smaps()
    pools = [r.pool for r in started.engine._runners.values()]
    points["after trim"]["kv pool resident"] = sum(tensor_resident_bytes(t) for p in pools for t in (p.keys, p.values))
    seen = {}
    for t in (t for m in models for t in (*m.parameters(), *m.buffers())):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    points["after trim"]["weights resident"] = sum(tensor_resident_bytes(t) for t in seen.values())
    runner = started.engine.primary_runner
    print(json.dumps({"points": points, "static_bytes": static_bytes(*models),
                      "kv_bytes_per_token": runner.kv_bytes_per_token, "block_tokens": runner.block_tokens,
                      "pool_bytes": sum(p.keys.nbytes + p.values.nbytes for p in pools),
                      "format": started.record.format}))


async def requests(port: int, token: str, pid: int, n: int, prompt: list[int], max_tokens: int) -> dict:
    import grpc

    from keel.common.v1 import common_pb2
    from keel.inference.v1 import inference_pb2, inference_pb2_grpc
    from shared.meshauth import HEADER

    out = {"points": {"serving": smaps(pid)}, "latency": []}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = inference_pb2_grpc.InferenceStub(ch)
        for i in range(n):
            req = inference_pb2.GenerateRequest(prompt_ids=prompt, sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0.0, seed=0, ignore_eos=True))
            t0, first, tokens = time.perf_counter(), None, 0
            async for ev in stub.Generate(req, metadata=((HEADER, token),), timeout=600):
                if ev.HasField("token"):
                    first = first or time.perf_counter() - t0
                    tokens += 1
            total = time.perf_counter() - t0
            out["latency"].append({"ttft_ms": round(first * 1e3, 1), "total_ms": round(total * 1e3, 1),
                                   "tokens": tokens})
            if i == 0:
                out["points"]["after 1 request"] = smaps(pid)
    out["points"][f"after {n} requests"] = smaps(pid)
    return out


def run_stage(args, scratch: Path) -> dict:
    from bench.bench_restart import free_port, start, wait_serving

    port, token = free_port(), "bench-memory"
    env = {**env_for(args, scratch, port), "KEEL_MESH_TOKEN": token}
    scratch.mkdir(parents=True, exist_ok=True)
    proc = start(ROOT, env, scratch / "stage.log")
    try:
        wait_serving(port, proc, limit_s=600)
        prompt = [3 + (i * 7919) % 40000 for i in range(args.prompt_tokens)]
        return asyncio.run(requests(port, token, proc.pid, args.requests, prompt, args.max_tokens))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def table(points: dict[str, dict], target: float) -> list[str]:
    lines = ["| point | RSS MiB | anonymous | [heap] | files | other | RSS / (file + KV used) |",
             "|---|---|---|---|---|---|---|"]
    for name, p in points.items():
        if "total" not in p:
            continue
        lines.append(f"| {name} | {p['total'] / MIB:.0f} | {p['anonymous'] / MIB:.0f} | {p['heap'] / MIB:.0f} | "
                     f"{p['files'] / MIB:.0f} | {p['other'] / MIB:.0f} | {p['total'] / target:.2f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--format", default="gguf")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        startup_child()
        return 0
    from bench.lib.machine import machine_line
    from shared.modelfile import model_path

    model = (args.model or model_path()).resolve()
    args.model = args.model and model
    load0 = os.getloadavg()[0]
    scratch = Path(tempfile.mkdtemp(prefix="keel-memory-"))
    try:
        env = env_for(args, scratch / "startup")
        out = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--child", "--format", args.format],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stderr[-4000:])
            return 1
        start = json.loads(out.stdout.strip().splitlines()[-1])
        stage = run_stage(args, scratch / "stage")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    file_bytes = model.stat().st_size
    bt, per = start["block_tokens"], start["kv_bytes_per_token"]
    kv_used = -(-(args.prompt_tokens + args.max_tokens) // bt) * bt * per
    target = file_bytes + kv_used
    after = start["points"]["after trim"]
    print(f"model {model} ({file_bytes / MIB:.0f} MiB), format {start['format']}, KV used {kv_used / MIB:.2f} MiB "
          f"({args.prompt_tokens} + {args.max_tokens} positions, {per} B each); "
          f"weights {start['static_bytes'] / MIB:.0f} MiB; KV pools {start['pool_bytes'] / MIB:.0f} MiB reserved, "
          f"{after['kv pool resident'] / MIB:.1f} MiB "
          f"resident after warm-up; weights resident {after['weights resident'] / MIB:.0f} MiB")
    print("\nstart-up, in process:")
    print("\n".join(table(start["points"], target)))
    print("\nthe stage (gRPC):")
    print("\n".join(table(stage["points"], target)))
    print(f"\nrequest latency (prompt {args.prompt_tokens}, {args.max_tokens} tokens): {stage['latency']}")
    print(f"load average {load0:.2f} at the start; {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
