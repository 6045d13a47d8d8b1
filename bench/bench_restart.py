"""Time from `kill -9` of the inference stage to SERVING again, cold (no stored calibration) vs warm.

The stage runs alone as `python -m services.inference` (the command the supervisor runs) on free ports,
with KEEL_VAR_DIR pointing at a scratch folder that holds a copy of the gate results. With
--peer-root, a second checkout's stage (e.g. the previous main in a `git worktree`) runs beside it and
the two are killed and restarted in turn, so both see the same load; the summary gives the ratio. Each round:
SIGKILL the running process, start it again at once (as the supervisor does, minus its 0.2 s
backoff), and poll grpc.health.v1 until SERVING. Cold rounds delete the stored warm-start records
before the restart; warm rounds keep them. The page cache is warm in both (the model was read
before). For each restart the stage's own "engine warm" log line gives its start-up phases.

Run: .venv/bin/python -m bench.bench_restart [--kills 10] [--cold-kills 5] [--format auto] [--threads 1]
     [--adapters var/adapters-src/pirate ... [--corrupt-last]] [--peer-root ../keel-main]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.lib.machine import machine_line
from shared.modelfile import source as model_source

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def start(root: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.inference"], cwd=root, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("ab"), start_new_session=True)


def wait_serving(port: int, proc: subprocess.Popen, limit_s: float = 300) -> float:
    t0 = time.monotonic()
    while not serving(port):
        if proc.poll() is not None:
            raise SystemExit(f"the stage exited with {proc.returncode}")
        if time.monotonic() - t0 > limit_s:
            raise SystemExit("the stage did not reach SERVING")
        time.sleep(0.02)
    return time.monotonic() - t0


def last_line(log: Path, message: str) -> dict:
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{") and f'"{message}' in x]
    return lines[-1] if lines else {}


def last_warm_line(log: Path) -> dict:
    return last_line(log, "engine warm")


class Stage:
    """One checkout's inference stage: its own scratch var dir (with a copy of the gate results), ports
    and log, and the times it took to come back."""

    def __init__(self, label: str, root: Path, args):
        self.label, self.root = label, root
        self.scratch = Path(tempfile.mkdtemp(prefix=f"keel-restart-{label}-"))
        src_gate = Path(os.environ.get("KEEL_VAR_DIR", ROOT / "var")) / "gate"
        if src_gate.exists():
            shutil.copytree(src_gate, self.scratch / "gate")
        self.port = free_port()
        self.env = {**os.environ, "KEEL_VAR_DIR": str(self.scratch), "KEEL_INFERENCE_SERVER__PORT": str(self.port),
                    "KEEL_INFERENCE_SERVER__METRICS_PORT": str(free_port()),
                    "KEEL_INFERENCE_ENGINE__FORMAT": args.format,
                    "KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": str(args.threads),
                    # the prepared models of this checkout (the scratch var dir has none)
                    "KEEL_MODELS_DIR": str(model_source().cache_dir.parent),
                    # the code of this checkout, whatever PYTHONPATH the bench was started with
                    "PYTHONPATH": os.pathsep.join((str(root), str(root / "gen")))}
        self.log = self.scratch / "stage.log"
        registered = []
        for adapter in args.adapters:  # registered in the scratch registry before the first start
            out = subprocess.run([sys.executable, "-m", "keelctl", "lora", "register", str(adapter.resolve()),
                                  "--format", args.format], cwd=root, env=self.env, check=True, capture_output=True,
                                 text=True).stdout
            registered.append(Path(next(x for x in out.splitlines() if x.startswith("registered")).split(" in ")[1]))
        if args.corrupt_last and registered:  # its weights no longer match its manifest: refused at every start
            weights = registered[-1] / "adapter_model.safetensors"
            data = bytearray(weights.read_bytes())
            data[-1] ^= 0xFF
            weights.write_bytes(bytes(data))
        self.results: dict[str, list[float]] = {"cold": [], "warm": []}
        self.phases: dict[str, list[dict]] = {"cold": [], "warm": []}
        self.listening: dict[str, list[float]] = {"cold": [], "warm": []}
        self.proc = start(root, self.env, self.log)
        first = wait_serving(self.port, self.proc)
        print(f"{label}: first start (cold, page cache as found): {first:.2f} s; "
              f"{last_warm_line(self.log).get('phases_s')}", flush=True)

    def kill_and_restart(self, mode: str) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if mode == "cold":
            for rec in (self.scratch / "warm").glob("engine-*.json"):
                rec.unlink()
        t0, wall0 = time.monotonic(), time.time()
        self.proc = start(self.root, self.env, self.log)
        wait_serving(self.port, self.proc)
        self.results[mode].append(time.monotonic() - t0)
        line = last_warm_line(self.log)
        # Process start to "listening" (interpreter, imports, config, model hash, gRPC server up).
        self.listening[mode].append(last_line(self.log, "listening").get("ts", wall0) - wall0)
        self.phases[mode].append(line.get("phases_s", {}))
        checked = last_line(self.log, "adapters checked")
        print(f"{self.label} {mode}: {self.results[mode][-1]:.2f} s to SERVING, format {line.get('format')}, "
              f"warm_start {line.get('warm_start')}, phases {line.get('phases_s')}"
              + (f", adapters accepted {checked.get('accepted')} refused "
                 f"{checked.get('refused')}" if checked else ""), flush=True)

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--cold-kills", type=int, default=5)
    ap.add_argument("--format", default="auto", help="the weight format, or auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adapters", type=Path, nargs="*", default=[],
                    help="PEFT adapter folders to register before the first start (e.g. var/adapters-src/*)")
    ap.add_argument("--corrupt-last", action="store_true",
                    help="flip a byte of the last registered adapter's weights, so that every start refuses it")
    ap.add_argument("--peer-root", type=Path, default=None,
                    help="another checkout (e.g. a `git worktree` of the previous main) restarted in turn with this "
                         "one")
    args = ap.parse_args(argv)
    stages = [Stage("this", ROOT, args)]
    if args.peer_root is not None:
        stages.append(Stage("peer", args.peer_root.resolve(), args))
    for mode, n in (("cold", args.cold_kills), ("warm", args.kills)):
        for _ in range(n):
            for stage in stages:  # in turn, so both see the same load
                stage.kill_and_restart(mode)
    for stage in stages:
        stage.close()
    print(f"\nCommand: `.venv/bin/python -m bench.bench_restart {' '.join(argv or sys.argv[1:])}`")
    print(machine_line() + "\n")
    print("| checkout | start | kills | p50 s to SERVING | max s | p50 s to listening (imports, config) | "
          "engine phases (median s) |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("cold", "warm"):
        for stage in stages:
            xs = stage.results[mode]
            if not xs:
                continue
            keys = stage.phases[mode][0].keys() if stage.phases[mode] else []
            med = {k: round(statistics.median(p.get(k, 0) for p in stage.phases[mode]), 3) for k in keys}
            print(f"| {stage.label} | {mode} | {len(xs)} | {statistics.median(xs):.2f} | {max(xs):.2f} | "
                  f"{statistics.median(stage.listening[mode]):.2f} | {med} |")
        if len(stages) == 2 and stages[1].results[mode]:
            ratio = statistics.median(stages[0].results[mode]) / statistics.median(stages[1].results[mode])
            print(f"\n{mode}: p50 this / peer = {ratio:.2f}x\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
