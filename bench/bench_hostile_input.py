"""One hostile request must not slow everyone else: latency of an unrelated ValidateInput while
hostile 32 KB prompts are in flight, as a ratio to the same requests on a quiet validator.

Run: .venv/bin/python -m bench.bench_hostile_input [--requests 40] [--hostile 3]
                                                   [--peer-root /work/main --peer-requests 5]
     .venv/bin/python -m bench.bench_hostile_input --rules

``--rules`` instead times each configured pattern rule alone (``CompiledRules.failures``,
normalisation included; best of 3) on the adversarial 32 KB texts of
tests/validator/test_hostile_rules.py, worst case per rule, against the same rule on 32 KB of
ordinary mixed Chinese and English prose (peer): a ratio near 1 means the hostile text costs what
any text of its size does.

The validator stage runs as its own process (``python -m services.validator``, this checkout's
config) against a redis-server of its own on free loopback ports. Phase "quiet": ``--requests``
unrelated requests one after another. Phase "hostile": the same requests while ``--hostile``
clients keep a 32,000-character prompt of ``{{`` (and of ``<`` then spaces) in flight without
pause. ``--peer-root`` repeats both phases against another checkout's validator (for instance
the one before the input rules ran on RE2), with ``--peer-requests`` unrelated requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from keel.validator.v1 import validator_pb2, validator_pb2_grpc
from keelctl import health

ROOT = Path(__file__).resolve().parents[1]

TOKEN = "bench-mesh-token-0123456789"
NORMAL = json.dumps({"prompt": "What is the capital of France?", "max_tokens": 64})
HOSTILE = [json.dumps({"prompt": "{{" * 16000, "max_tokens": 64}),
           json.dumps({"prompt": "<" + " " * 31999, "max_tokens": 64})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_validator(root: Path, tmp: Path, redis_port: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, KEEL_MESH_TOKEN=TOKEN, KEEL_VALIDATOR_SERVER__PORT=str(port),
               KEEL_VALIDATOR_SERVER__METRICS_PORT=str(free_port()), KEEL_TRACES_DIR=str(tmp / "traces"),
               KEEL_VALIDATOR_QUARANTINE__REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
               KEEL_VALIDATOR_QUARANTINE__SPILL_PATH=str(tmp / f"spill-{port}.jsonl"), PYTHONPATH=str(ROOT / "gen"))
    proc = subprocess.Popen([sys.executable, "-m", "services.validator"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"validator-{port}.log", "wb"))
    target = f"127.0.0.1:{port}"
    health.wait_serving({"validator": (target, "keel.validator.v1.Validator")}, 120, lambda: proc.poll() is None)
    return proc, target


async def call(stub, payload: str) -> float:
    start = time.perf_counter()
    try:
        await stub.ValidateInput(validator_pb2.ValidateInputRequest(payload_json=payload, source="default",
                                                                    domain="default"),
                                 metadata=(("x-keel-mesh-token", TOKEN),), timeout=600)
    except grpc.aio.AioRpcError:
        pass   # a refusal is an answer too; only its latency matters here
    return time.perf_counter() - start


async def phase(target: str, requests: int, hostile: int) -> dict:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = validator_pb2_grpc.ValidatorStub(ch)
        await call(stub, NORMAL)   # warm the channel
        stop = asyncio.Event()
        hostile_s: list[float] = []

        async def attacker(i: int) -> None:
            while not stop.is_set():
                hostile_s.append(await call(stub, HOSTILE[i % len(HOSTILE)]))
        attackers = [asyncio.create_task(attacker(i)) for i in range(hostile)]
        await asyncio.sleep(0.2 if hostile else 0)
        samples = []
        for _ in range(requests):
            samples.append(await call(stub, NORMAL))
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*attackers)
    samples.sort()
    return {"p50_ms": statistics.median(samples) * 1e3, "max_ms": samples[-1] * 1e3, "n": len(samples),
            "hostile_done": len(hostile_s),
            "hostile_p50_ms": statistics.median(hostile_s) * 1e3 if hostile_s else float("nan")}


def measure(root: Path, tmp: Path, redis_port: int, requests: int, hostile: int) -> dict:
    proc, target = start_validator(root, tmp, redis_port)
    try:
        quiet = asyncio.run(phase(target, requests, 0))
        loud = asyncio.run(phase(target, requests, hostile))
    finally:
        proc.terminate()
        proc.wait(30)
    return {"quiet": quiet, "hostile": loud, "ratio": loud["p50_ms"] / quiet["p50_ms"]}


def rule_costs() -> None:
    from testing.hostile import DELIMITERS, OPENED, PATTERN_RULES, SIZE, cost_s, fill
    prose = fill("本月一年期LPR为3.45%，与上月持平。The central bank kept its rate unchanged. ")
    hostile = [fill(p) for p in DELIMITERS] + OPENED
    print(f"| rule | worst of {len(hostile)} adversarial {SIZE // 1024} KB texts (ms) | 32 KB prose (ms) | ratio |")
    print("| --- | --- | --- | --- |")
    for name, rule in sorted(PATTERN_RULES.items()):
        worst = max(min(cost_s(rule, t) for _ in range(3)) for t in hostile)
        plain = min(cost_s(rule, prose) for _ in range(3))
        print(f"| {name} | {worst * 1e3:.2f} | {plain * 1e3:.2f} | {worst / plain:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", action="store_true")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--hostile", type=int, default=3)
    ap.add_argument("--peer-root", type=Path)
    ap.add_argument("--peer-requests", type=int, default=5)
    args = ap.parse_args()
    if args.rules:
        rule_costs()
        return
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        redis_port = free_port()
        redis = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", str(redis_port),
                                  "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            runs = {"this checkout": measure(ROOT, tmp, redis_port, args.requests, args.hostile)}
            if args.peer_root:
                runs[f"peer {args.peer_root}"] = measure(args.peer_root, tmp, redis_port, args.peer_requests,
                                                         args.hostile)
        finally:
            redis.terminate()
            redis.wait(10)
    print(f"| validator | unrelated p50 quiet (ms) | unrelated p50 with {args.hostile} hostile in flight (ms) "
          f"| max (ms) | ratio | hostile requests answered, p50 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        q, h = r["quiet"], r["hostile"]
        print(f"| {name} | {q['p50_ms']:.1f} (n={q['n']}) | {h['p50_ms']:.1f} (n={h['n']}) | {h['max_ms']:.1f} "
              f"| {r['ratio']:.2f} | {h['hostile_done']}, {h['hostile_p50_ms']:.1f} |")


if __name__ == "__main__":
    main()
