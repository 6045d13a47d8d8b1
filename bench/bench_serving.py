"""Serving benchmark: Keel through the full mesh and against the inference stage alone, with its peers
in the same run on the same prompts, output lengths mixed.

Run:  .venv/bin/python -m bench.bench_serving [--requests 64] [--concurrency 1,4,16,64]
      [--formats gguf[,gguf@1]] [--write docs/bench/serving.md]     (format@T: T intra-op threads)
      [--model PATH.gguf] [--ignore-eos]
Needs the bench-only extra for the llama.cpp peer: `make bench-deps` (compiles llama-cpp-python, ~5 min).
--model serves that GGUF (KEEL_MODEL, formats.force: a file of its own has no gate results) instead
of the configured model; only the llama.cpp peers run, on the same file (the transformers peers need
the model's Hugging Face weights). --ignore-eos: every request runs to its max_tokens (sampling's
ignore_eos), for random-weight models (bench/lib/qwen05b.py), which end early at random.

Workload: --requests chat prompts (the FORMS x SUBJECTS of services/inference/formats/gateprompts.py),
max_tokens cycling through --max-tokens, greedy, the model's eos on (unless --ignore-eos): lengths are
mixed by both. Keel runs first, one mesh per format
(`keelctl up` on free ports, the real model, KEEL_INFERENCE_ENGINE__FORMAT), each of N clients a closed
loop over the shared list (N=1 takes the first 8 requests, N=4 the first 16, more take all): once
straight to the inference stage (pre-tokenized ids, the mesh token), once through the gateway's
GenerateStream (auth, tokenizer, validator both ways, retries, traces). The peers then run alone, each
in a fresh process, producing exactly the per-request lengths Keel's first format produced (eos off):
  hf-static       model.generate on left-padded batches of 16, each batch as long as its longest request
  generate-batch  transformers' continuous batching (paged attention), one request per prompt, own length,
                  all handed over at once (generate-batch) or 16 in flight (generate-batch-16)
  hf-batch1       model.generate on one request at a time (batch 1), on the one-client subset
                  (the three: bench/lib/hf_peers.py)
  llama-cpp       llama-cpp-python on the same GGUF, 2 threads, one request at a time
  llama-cpp-batched  llama.cpp's batched decoding of up to 16 sequences in one context (bench/lib/llamacpp_peer.py)
tok/s = generated tokens / wall time of the whole set. TTFT from the call to the first streamed event;
ITL between events (a gateway delta can hold two tokens when it completes a UTF-8 sequence).
The inference stage's resident memory (RSS) is read after the first two requests and at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import gguf
import grpc
import psutil
import torch

from bench.bench_inference import machine
from bench.lib import hf_peers, llamacpp_peer
from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keelctl.ask import DEV_API_KEY
from services.inference.formats.gateprompts import FORMS, SUBJECTS
from services.tokenizer.compiler import compile_vocab, compiled_path
from services.tokenizer.core import Tokenizer
from shared import ggufmeta
from shared.config import var_dir
from shared.meshauth import HEADER as MESH_TOKEN_KEY
from shared.modelfile import ENV as MODEL_ENV
from shared.modelfile import model_path
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

ROOT = Path(__file__).resolve().parent.parent

STATIC_BATCH = hf_peers.STATIC_BATCH
CPU_STAGES = ("inference", "gateway", "tokenizer", "validator", "redis")
PEER_CLIENTS = {"hf-static": "batches of 16", "generate-batch": "all at once", "generate-batch-16": "16 in flight",
                "llama-cpp": "1 (one at a time)", "llama-cpp-batched": "16 in flight", "hf-batch1": "1 (one at a time)"}
SINGLE_STREAM = ("llama-cpp", "hf-batch1")  # peers that serve the one-client subset, one request at a time


@dataclass(frozen=True)
class Job:
    index: int
    text: str
    ids: list[int]
    max_tokens: int


@dataclass
class Result:
    """One set of requests served by one system: generated tokens per job and latency samples (s)."""
    wall: float = 0.0
    tokens: dict[int, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)  # status code name -> requests
    cpu: dict[str, float] = field(default_factory=dict)  # mesh stage -> CPU seconds during the run
    rss: dict[str, int] = field(default_factory=dict)  # "warm" / "end" -> the inference stage's RSS (bytes)

    @property
    def tok_s(self) -> float:
        return sum(self.tokens.values()) / self.wall

    def row(self) -> str:
        def ms(xs, q):
            return f"{sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3:.0f}" if xs else "-"
        failed = ", ".join(f"{n} {code}" for code, n in self.failed.items()) or "0"
        return (f"{len(self.tokens)} | {failed} | {sum(self.tokens.values())} | {self.tok_s:.1f} | "
                f"{ms(self.ttft, .5)} / {ms(self.ttft, .99)} | {ms(self.itl, .5)} / {ms(self.itl, .99)}")


def workload(n: int, max_tokens: list[int]) -> list[Job]:
    src = model_source()
    tok = Tokenizer.open(compile_vocab(src.path, compiled_path(src)))  # a --model file is compiled here first
    tok.self_check()
    tok.warmup()
    texts = [f.format(s) for f in FORMS for s in SUBJECTS][:n]
    return [Job(i, t, list(tok.encode(tok.render_chat([("user", t)])).input_ids), max_tokens[i % len(max_tokens)])
            for i, t in enumerate(texts)]


def subset(jobs: list[Job], clients: int) -> list[Job]:
    return jobs[:max(8, min(len(jobs), 4 * clients))] if clients < 16 else jobs


# A call serves one job: it awaits the RPC, calls `event()` at each streamed token or delta, and
# returns the number of tokens generated.
Call = Callable[[Job, Callable[[], None]], Awaitable[int]]


class EventClock:
    """Called at each streamed event of one request: the first gives its TTFT, the others ITLs."""

    def __init__(self, res: Result):
        self.res, self.start, self.last = res, time.perf_counter(), None

    def __call__(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.res.ttft.append(now - self.start)
        else:
            self.res.itl.append(now - self.last)
        self.last = now


async def drive(jobs: list[Job], clients: int, call: Call) -> Result:
    """`clients` closed-loop clients over one shared iterator of jobs."""
    res, pending = Result(), iter(jobs)

    async def client() -> None:
        for job in pending:
            try:
                res.tokens[job.index] = await call(job, EventClock(res))
            except grpc.aio.AioRpcError as e:
                res.failed[e.code().name] = res.failed.get(e.code().name, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    res.wall = time.perf_counter() - t0
    return res


def sampling(job: Job, ignore_eos: bool) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=job.max_tokens, temperature=0.0, seed=0, ignore_eos=ignore_eos)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each mesh process (the stage's name without its replica)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        stage = name.split("-")[0]
        out[stage] = out.get(stage, 0.0) + t.user + t.system
    return out


def inference_rss(pids: dict[str, int]) -> int:
    """Resident bytes of the inference stage's processes."""
    return sum(psutil.Process(pid).memory_info().rss for name, pid in pids.items() if name.startswith("inference"))


def calls(gch: grpc.aio.Channel, sch: grpc.aio.Channel, token: str, ignore_eos: bool) -> dict[str, Call]:
    """The two ways to serve a job: "stage", pre-tokenized ids straight to the inference stage (channel
    `sch`, the mesh token), and "mesh", the prompt's text through the gateway's GenerateStream (`gch`)."""
    gw, inf = gateway_pb2_grpc.GatewayStub(gch), inference_pb2_grpc.InferenceStub(sch)

    async def via_stage(job: Job, event) -> int:
        n = 0
        req = inference_pb2.GenerateRequest(prompt_ids=job.ids, sampling=sampling(job, ignore_eos))
        async for ev in inf.Generate(req, metadata=((MESH_TOKEN_KEY, token),), timeout=600):
            if ev.HasField("token"):
                event()
                n += 1
        return n

    async def via_mesh(job: Job, event) -> int:
        req = gateway_pb2.GenerateRequest(prompt=job.text, sampling=sampling(job, ignore_eos))
        async for ev in gw.GenerateStream(req, metadata=(("x-api-key", DEV_API_KEY),), timeout=600):
            if ev.HasField("delta"):
                event()
            else:
                return ev.done.usage.completion_tokens
        raise RuntimeError("stream ended without a summary")

    return {"stage": via_stage, "mesh": via_mesh}


async def keel_runs(gateway: str, stage: str, token: str, jobs: list[Job], concurrency: list[int],
                    pids: dict[str, int], ignore_eos: bool) -> dict[tuple[str, int], Result]:
    out = {}
    async with grpc.aio.insecure_channel(gateway) as gch, grpc.aio.insecure_channel(stage) as sch:
        paths = calls(gch, sch, token, ignore_eos)
        await drive(jobs[:2], 2, paths["mesh"])  # first-use effects (channels, caches) out of the way
        warm = inference_rss(pids)
        for c in concurrency:
            for path, call in paths.items():
                before = cpu_seconds(pids)
                out[(path, c)] = await drive(subset(jobs, c), c, call)
                out[(path, c)].cpu = {k: v - before[k] for k, v in cpu_seconds(pids).items()}
                out[(path, c)].rss = {"warm": warm, "end": inference_rss(pids)}
                print(f"  {path} x{c}: {out[(path, c)].tok_s:.1f} tok/s", flush=True)
    return out


@contextlib.contextmanager
def serving_mesh(variant: str, max_batch: int, force: bool = False) -> Iterator[tuple[str, str, str, dict[str, int]]]:
    """One mesh serving `variant`: a weight format, or format@T for T intra-op threads in the inference
    stage (else the config's), batches up to `max_batch` rows; `force`: even without a passed quality
    gate (formats.force). Yields (gateway address, inference stage address, mesh token, pid per process)."""
    format, _, threads = variant.partition("@")
    env = {"KEEL_INFERENCE_ENGINE__FORMAT": format, "KEEL_INFERENCE_ENGINE__MAX_BATCH_SIZE": str(max_batch)}
    if threads:
        env["KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS"] = threads
    if force:
        env["KEEL_INFERENCE_FORMATS__FORCE"] = "true"
    tmp = Path(tempfile.mkdtemp(prefix="keel-serving-"))
    if (var_dir() / "gate").exists():  # the mesh's scratch var/ gets the gate results a format needs
        shutil.copytree(var_dir() / "gate", tmp / "var" / "gate")
    mesh = start_mesh(tmp, extra_env=env)
    try:
        procs = mesh.state()["processes"]
        yield (mesh.gateway, f"127.0.0.1:{mesh.ports['inference'][0]}", mesh.state()["mesh_token"],
               {name: p["pid"] for name, p in procs.items() if p.get("pid")})
    finally:
        stop_mesh(mesh)


def keel(variant: str, jobs: list[Job], concurrency: list[int], ignore_eos: bool = False,
         force: bool = False) -> dict[tuple[str, int], Result]:
    """`keel_runs` on one mesh serving `variant` (serving_mesh). Batches up to the largest client count:
    with the default 16, 64 clients queue 48 requests for longer than the queue timeout (10 s at most),
    and they get RESOURCE_EXHAUSTED instead."""
    with serving_mesh(variant, max(concurrency), force) as (gateway, stage, token, pids):
        return asyncio.run(keel_runs(gateway, stage, token, jobs, concurrency, pids, ignore_eos))


def run_peer(name: str, format: str, jobs: list[Job], lengths: dict[int, int]) -> Result:
    """One peer in a fresh process of its own: once a thread of a process has run torch, torch on
    its other threads is slower (bench/probes/torch_thread.py), and transformers' continuous
    batching runs its loop on a thread of its own."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"name": name, "format": format, "lengths": lengths,
                   "jobs": [[j.index, j.text, j.ids, j.max_tokens] for j in jobs]}, f)
    out = subprocess.run([sys.executable, "-m", __spec__.name, "--peer-child", f.name], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    Path(f.name).unlink()
    r = json.loads(out.strip().splitlines()[-1])
    return Result(r["wall"], {int(k): v for k, v in r["tokens"].items()}, r["ttft"], r["itl"])


def peer_child(spec_file: Path) -> None:
    spec = json.loads(spec_file.read_text())
    jobs, lengths = [Job(*j) for j in spec["jobs"]], {int(k): v for k, v in spec["lengths"].items()}
    name, format = spec["name"], spec["format"]
    if name == "llama-cpp":
        res = llamacpp_peer.single(jobs, lengths, Result, EventClock)
    elif name == "llama-cpp-batched":
        res = llamacpp_peer.batched(jobs, lengths, Result, EventClock, STATIC_BATCH)
    elif name == "hf-static":
        res = hf_peers.hf_static(format, jobs, lengths, Result)
    elif name == "hf-batch1":
        res = hf_peers.hf_batch1(format, jobs, lengths, Result)
    else:
        res = hf_peers.hf_continuous(format, jobs, lengths, Result, STATIC_BATCH if name.endswith("-16") else None)
    print(json.dumps({"wall": res.wall, "tokens": res.tokens, "ttft": res.ttft, "itl": res.itl}))


def file_type(path: Path) -> str:
    """The GGUF's general.file_type as llama-quantize names it ("Q4_K_M", "Q4_1", "F16")."""
    ftype = gguf.LlamaFileType(ggufmeta.read(path).get("general.file_type"))
    return ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def peer_plan(names: list[str], own_model: bool, gguf_type: str) -> list[tuple[str, str]]:
    """(peer, format) of each peer run: the llama.cpp ones on the served GGUF (of type `gguf_type`), the
    transformers ones in float32 and bfloat16, unless the model is a --model file (`own_model`)."""
    plan = []
    for name in names:
        if name.startswith("llama-cpp"):
            plan.append((name, gguf_type))
        elif not own_model:
            plan += [(name, "float32"), (name, "bfloat16")]
    return plan


def ratios(keel_res, peers, formats, concurrency, gguf_type: str, own_model: bool) -> list[str]:
    """Keel against its peers on the same requests. The targets are the shipped model's (issues #11,
    #26); a --model file's are where its rows are recorded (docs/BENCHMARKS.md)."""
    lines = []
    hf = {k: v for k, v in peers.items() if not k[0].startswith("llama-cpp") and k[0] not in SINGLE_STREAM}
    if hf and 16 in concurrency:
        (bname, bd), best = max(hf.items(), key=lambda kv: kv[1].tok_s)
        for d in formats:
            r = keel_res[d][("mesh", 16)]
            lines.append(f"- 16 clients through the mesh, {d}: {r.tok_s:.1f} tok/s vs best transformers peer, "
                         f"{bname} {bd} {best.tok_s:.1f} tok/s = **{r.tok_s / best.tok_s:.2f}x** (target 1.5x)")
    against = [("mesh", 16, "llama-cpp-batched", 1.2), ("stage", 16, "llama-cpp-batched", None),
               ("mesh", 1, "llama-cpp", 1.0), ("stage", 1, "llama-cpp", 1.2), ("mesh", 1, "hf-batch1", 1.5)]
    labels = {"llama-cpp-batched": "llama.cpp batched decoding", "llama-cpp": "llama.cpp single stream",
              "hf-batch1": "HF generate float32 at batch 1"}
    for path, clients, peer, target in against:
        key = (peer, "float32" if peer.startswith("hf") else gguf_type)
        if key not in peers or clients not in concurrency:
            continue
        ref = peers[key]
        for d in formats:
            r = keel_res[d][(path, clients)]
            where = "through the mesh" if path == "mesh" else "to the inference stage alone"
            wanted = f" (target {target}x)" if target and not own_model else ""
            lines.append(f"- {clients} client{'s' * (clients > 1)} {where}, {d}: {r.tok_s:.1f} tok/s vs "
                         f"{labels[peer]} {key[1]} {ref.tok_s:.1f} tok/s on the same {len(ref.tokens)} requests = "
                         f"**{r.tok_s / ref.tok_s:.2f}x**{wanted}")
    return lines


def report(jobs, args, keel_res, peers, lengths, cmd: str, gguf_type: str) -> str:
    formats, concurrency = args.formats, args.concurrency
    head = ("| system | format | clients | requests served | failed | tokens | tok/s | TTFT p50 / p99 ms "
            "| ITL p50 / p99 ms |\n" + "|---" * 9 + "|")
    served = model_path()
    lines = ["# Serving benchmark", "", f"Command: `{cmd}`", f"Machine: {machine()}",
             f"Model: {served} ({gguf_type}, {served.stat().st_size / 2**20:.0f} MiB)" if served.is_file() else
             f"Model: {served}", "", (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             f"Output lengths (Keel {formats[0]}, greedy, eos {'ignored' if args.ignore_eos else 'on'}): mean "
             f"{statistics.mean(lengths.values()):.1f}, min {min(lengths.values())}, max {max(lengths.values())} "
             f"over {len(lengths)} requests.", "", "## Keel", "", head]
    for d in formats:
        for c in concurrency:
            for path in ("stage", "mesh"):
                name = "inference stage alone (gRPC)" if path == "stage" else "full mesh (gateway stream)"
                lines.append(f"| {name} | {d} | {c} | {keel_res[d][(path, c)].row()} |")
    lines += ["", "CPU seconds each mesh process used during a run, per second of the run (2 cores = 2.0):", "",
              "| path | format | clients | " + " | ".join(CPU_STAGES) + " |", "|---" * (3 + len(CPU_STAGES)) + "|"]
    for d in formats:
        for c in concurrency:
            for path in ("stage", "mesh"):
                r = keel_res[d][(path, c)]
                lines.append(f"| {path} | {d} | {c} | " + " | ".join(f"{r.cpu.get(s, 0) / r.wall:.2f}"
                                                                     for s in CPU_STAGES) + " |")
    lines.append("")
    for d in formats:
        rss = keel_res[d][("mesh", concurrency[-1])].rss
        lines.append(f"Inference stage RSS, {d}: {rss['warm'] / 2**20:.0f} MiB after the first two requests, "
                     f"{rss['end'] / 2**20:.0f} MiB at the end.")
    lines += ["", "## Peers (alone, same prompts, Keel's lengths)", "", head]
    for (name, d), r in peers.items():
        lines.append(f"| {name} | {d} | {PEER_CLIENTS[name]} | {r.row()} |")
    lines += ["", "## Against the targets", ""]
    lines += ratios(keel_res, peers, formats, concurrency, gguf_type, args.model is not None)
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 48, 96, 160])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["gguf"])
    ap.add_argument("--peers", type=lambda s: [p for p in s.split(",") if p], default=list(PEER_CLIENTS))
    ap.add_argument("--model", type=Path, help="serve this GGUF instead (only the llama.cpp peers run, on it)")
    ap.add_argument("--ignore-eos", action="store_true", help="every request runs to its max_tokens")
    ap.add_argument("--write", type=Path)
    ap.add_argument("--peer-child", type=Path, help=argparse.SUPPRESS)
    return ap


def main() -> int:
    args = parser().parse_args()
    torch.set_num_threads(2)
    if args.peer_child:
        peer_child(args.peer_child)
        return 0
    if args.model:  # every stage of the mesh and every peer's process read the model from it
        os.environ[MODEL_ENV] = str(args.model.resolve())
    jobs = workload(args.requests, args.max_tokens)
    keel_res = {}
    for d in args.formats:
        print(f"keel {d}", flush=True)
        keel_res[d] = keel(d, jobs, args.concurrency, args.ignore_eos, force=args.model is not None)
    lengths = keel_res[args.formats[0]][("stage", max(args.concurrency))].tokens
    gguf_type = file_type(model_path())
    peers: dict[tuple[str, str], Result] = {}
    for name, d in peer_plan(args.peers, args.model is not None, gguf_type):
        peers[(name, d)] = run_peer(name, d, subset(jobs, 1) if name in SINGLE_STREAM else jobs, lengths)
        print(f"  {name} {d}: {peers[(name, d)].tok_s:.1f} tok/s", flush=True)
    cmd = " ".join([".venv/bin/python", "-m", "bench.bench_serving"] + sys.argv[1:])
    out = report(jobs, args, keel_res, peers, lengths, cmd, gguf_type)
    print(out)
    if args.write:
        args.write.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
