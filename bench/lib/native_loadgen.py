"""The C++ open-loop SubmitFeedback sender (bench/lib/loadgen/submit_loadgen.cc), built here on first use.

It needs Debian's gRPC C++ toolchain, which `make bench-deps` installs (`make test` does not). The
stubs are generated from protos/ into build/loadgen/.
"""
from __future__ import annotations

import resource
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "bench/lib/loadgen/submit_loadgen.cc"
OUT = ROOT / "build/loadgen"
PROTOS = ("keel/gateway/v1/gateway.proto", "keel/common/v1/common.proto")


def build() -> Path:
    """The sender's executable, compiled again when its source or the protos are newer."""
    exe = OUT / "submit_loadgen"
    inputs = [SRC, *(ROOT / "protos" / p for p in PROTOS)]
    if exe.exists() and exe.stat().st_mtime > max(p.stat().st_mtime for p in inputs):
        return exe
    plugin = shutil.which("grpc_cpp_plugin")
    if not (plugin and shutil.which("protoc") and shutil.which("g++") and shutil.which("pkg-config")):
        raise SystemExit("--loadgen native needs the gRPC C++ toolchain: make bench-deps")
    OUT.mkdir(parents=True, exist_ok=True)
    subprocess.run(["protoc", f"-I{ROOT / 'protos'}", f"--cpp_out={OUT}", f"--grpc_out={OUT}",
                    f"--plugin=protoc-gen-grpc={plugin}", *PROTOS], check=True)
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"],
                           capture_output=True, text=True, check=True).stdout.split()
    sources = [OUT / p.replace(".proto", ".pb.cc") for p in PROTOS] + [OUT / PROTOS[0].replace(".proto", ".grpc.pb.cc")]
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{OUT}", str(SRC), *map(str, sources), "-o", str(exe), *flags],
                   check=True)
    return exe


def children_cpu_ms() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime + ru.ru_stime) * 1e3


def submit_open_native(exe: Path, target: str, api_key: str, trace_id: str, n: int, rate: float,
                       tag: str) -> tuple[float, list[float], int, float]:
    """(wall s, per-call ms from the scheduled send time, errors, the sender's CPU ms) of n upserts
    sent at ``rate``/s by the C++ sender, each a new feedback_id (``tag`` in it)."""
    cpu0 = children_cpu_ms()
    out = subprocess.run([str(exe), target, api_key, trace_id, str(n), repr(rate), tag],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    cpu = children_cpu_ms() - cpu0
    calls = [line.split() for line in out[:n]]
    wall = float(out[n].split()[1])
    return wall, [float(ms) for ms, _ in calls], sum(code != "0" for _, code in calls), cpu
