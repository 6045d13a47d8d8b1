"""Serving benchmark: Keel through the full mesh and against the inference stage alone, with its peers
in the same run on the same prompts, output lengths mixed.

Run:  .venv/bin/python -m bench.bench_serving [--requests 64] [--concurrency 1,4,16,64]
      [--formats gguf[,gguf@1]] [--write docs/bench/serving.md]     (format@T: T intra-op threads)
Needs the bench-only extra for the llama.cpp peer: `make bench-deps` (compiles llama-cpp-python, ~5 min).

Workload: --requests chat prompts (the FORMS x SUBJECTS of services/inference/formats/gateprompts.py),
max_tokens cycling through
--max-tokens, greedy, the model's eos on: lengths are mixed by both. Keel runs first, one mesh per format
(`keelctl up` on free ports, the real model, KEEL_INFERENCE_ENGINE__FORMAT), each of N clients a closed
loop over the shared list (N=1 takes the first 8 requests, N=4 the first 16, more take all): once
straight to the inference stage (pre-tokenized ids, the mesh token), once through the gateway's
GenerateStream (auth, tokenizer, validator both ways, retries, traces). The peers then run alone, each
in a fresh process, producing exactly the per-request lengths Keel's first format produced (eos off):
  hf-static       model.generate on left-padded batches of 16, each batch as long as its longest request
  generate-batch  transformers' continuous batching (paged attention), one request per prompt, own length,
                  all handed over at once (generate-batch) or 16 in flight (generate-batch-16)
  llama-cpp       llama-cpp-python on the same GGUF (Q4_1), 2 threads, one request at a time
  llama-cpp-batched  llama.cpp's batched decoding of up to 16 sequences in one context (bench/lib/llamacpp_peer.py)
  hf-batch1       model.generate on one request at a time (batch 1), on the one-client subset
tok/s = generated tokens / wall time of the whole set. TTFT from the call to the first streamed event;
ITL between events (a gateway delta can hold two tokens when it completes a UTF-8 sequence).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import grpc
import psutil
import torch

from bench.bench_inference import machine
from bench.lib import llamacpp_peer
from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keelctl.ask import DEV_API_KEY
from services.inference.formats.gateprompts import FORMS, SUBJECTS
from services.tokenizer.compiler import compiled_path
from services.tokenizer.core import Tokenizer
from shared.config import var_dir
from shared.meshauth import HEADER as MESH_TOKEN_KEY
from shared.modelfile import source as model_source
from testing.mesh import start_mesh, stop_mesh

ROOT = Path(__file__).resolve().parent.parent

STATIC_BATCH = 16
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
    tok = Tokenizer.open(compiled_path(model_source()))
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


def sampling(job: Job) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=job.max_tokens, temperature=0.0, seed=0)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each mesh process (the stage's name without its replica)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        stage = name.split("-")[0]
        out[stage] = out.get(stage, 0.0) + t.user + t.system
    return out


async def keel_runs(gateway: str, stage: str, token: str, jobs: list[Job], concurrency: list[int],
                    pids: dict[str, int]) -> dict[tuple[str, int], Result]:
    out = {}
    async with grpc.aio.insecure_channel(gateway) as gch, grpc.aio.insecure_channel(stage) as sch:
        gw, inf = gateway_pb2_grpc.GatewayStub(gch), inference_pb2_grpc.InferenceStub(sch)

        async def via_stage(job: Job, event) -> int:
            n = 0
            req = inference_pb2.GenerateRequest(prompt_ids=job.ids, sampling=sampling(job))
            async for ev in inf.Generate(req, metadata=((MESH_TOKEN_KEY, token),), timeout=600):
                if ev.HasField("token"):
                    event()
                    n += 1
            return n

        async def via_mesh(job: Job, event) -> int:
            req = gateway_pb2.GenerateRequest(prompt=job.text, sampling=sampling(job))
            async for ev in gw.GenerateStream(req, metadata=(("x-api-key", DEV_API_KEY),), timeout=600):
                if ev.HasField("delta"):
                    event()
                else:
                    return ev.done.usage.completion_tokens
            raise RuntimeError("stream ended without a summary")

        await drive(jobs[:2], 2, via_mesh)  # first-use effects (channels, caches) out of the way
        for c in concurrency:
            for path, call in (("stage", via_stage), ("mesh", via_mesh)):
                before = cpu_seconds(pids)
                out[(path, c)] = await drive(subset(jobs, c), c, call)
                out[(path, c)].cpu = {k: v - before[k] for k, v in cpu_seconds(pids).items()}
                print(f"  {path} x{c}: {out[(path, c)].tok_s:.1f} tok/s", flush=True)
    return out


def keel(variant: str, jobs: list[Job], concurrency: list[int]) -> dict[tuple[str, int], Result]:
    """One mesh serving `variant`: a weight format, or format@T for T intra-op threads in the inference
    stage (else the config's)."""
    format, _, threads = variant.partition("@")
    # Batches up to the largest client count: with the default 16, 64 clients queue 48 requests for
    # longer than the queue timeout (10 s at most), and they get RESOURCE_EXHAUSTED instead.
    env = {"KEEL_INFERENCE_ENGINE__FORMAT": format, "KEEL_INFERENCE_ENGINE__MAX_BATCH_SIZE": str(max(concurrency))}
    if threads:
        env["KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS"] = threads
    tmp = Path(tempfile.mkdtemp(prefix="keel-serving-"))
    if (var_dir() / "gate").exists():  # the mesh's scratch var/ gets the gate results a format needs
        shutil.copytree(var_dir() / "gate", tmp / "var" / "gate")
    mesh = start_mesh(tmp, extra_env=env)
    try:
        stage = f"127.0.0.1:{mesh.ports['inference'][0]}"
        procs = mesh.state()["processes"]
        pids = {name: p["pid"] for name, p in procs.items() if p.get("pid")}
        return asyncio.run(keel_runs(mesh.gateway, stage, mesh.state()["mesh_token"], jobs, concurrency, pids))
    finally:
        stop_mesh(mesh)


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM
    local = str(model_source().cache_dir)
    # bandit B615 does not apply: local dir.
    return AutoModelForCausalLM.from_pretrained(local, dtype=getattr(torch, dtype)).eval()  # nosec B615


@torch.inference_mode()
def hf_static(dtype: str, jobs: list[Job], lengths: dict[int, int]) -> Result:
    model, res = load_hf(dtype), Result()
    model.generate(torch.tensor([jobs[0].ids]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    t0 = time.perf_counter()
    for i in range(0, len(jobs), STATIC_BATCH):
        chunk = jobs[i:i + STATIC_BATCH]
        width, steps = max(len(j.ids) for j in chunk), max(lengths[j.index] for j in chunk)
        x = torch.tensor([[2] * (width - len(j.ids)) + j.ids for j in chunk])
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in chunk])
        model.generate(x, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       eos_token_id=None, pad_token_id=2)
        res.tokens.update({j.index: lengths[j.index] for j in chunk})  # a static batch runs to its longest
    res.wall = time.perf_counter() - t0
    return res


@torch.inference_mode()
def hf_continuous(dtype: str, jobs: list[Job], lengths: dict[int, int], in_flight: int | None = None) -> Result:
    """All requests handed over at once, or at most `in_flight` at a time (the next one added as one
    finishes, like that many closed-loop clients)."""
    from transformers import GenerationConfig
    model, res = load_hf(dtype), Result()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(lengths.values()), eos_token_id=-1, pad_token_id=2)
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        t0, waiting, ids = time.perf_counter(), iter(jobs), {}

        def submit() -> None:
            job = next(waiting, None)
            if job is not None:
                ids[manager.add_request(job.ids, max_new_tokens=lengths[job.index], eos_token_id=-1)] = job.index
        for _ in range(in_flight or len(jobs)):
            submit()
        while len(res.tokens) < len(jobs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                res.tokens[ids[out.request_id]] = len(out.generated_tokens)
                submit()
        res.wall = time.perf_counter() - t0
    return res


@torch.inference_mode()
def hf_batch1(dtype: str, jobs: list[Job], lengths: dict[int, int]) -> Result:
    """model.generate on one request at a time (batch 1), each as long as Keel's answer."""
    model, res = load_hf(dtype), Result()
    model.generate(torch.tensor([jobs[0].ids]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    t0 = time.perf_counter()
    for job in jobs:
        steps = lengths[job.index]
        model.generate(torch.tensor([job.ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       eos_token_id=None, pad_token_id=2)
        res.tokens[job.index] = steps
    res.wall = time.perf_counter() - t0
    return res


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
        res = hf_static(format, jobs, lengths)
    elif name == "hf-batch1":
        res = hf_batch1(format, jobs, lengths)
    else:
        res = hf_continuous(format, jobs, lengths, STATIC_BATCH if name.endswith("-16") else None)
    print(json.dumps({"wall": res.wall, "tokens": res.tokens, "ttft": res.ttft, "itl": res.itl}))


def report(jobs, concurrency, formats, keel_res, peers, lengths, cmd: str) -> str:
    head = ("| system | format | clients | requests served | failed | tokens | tok/s | TTFT p50 / p99 ms "
            "| ITL p50 / p99 ms |\n" + "|---" * 9 + "|")
    lines = ["# Serving benchmark", "", f"Command: `{cmd}`", f"Machine: {machine()}", "",
             (__doc__ or "").split("\n\n", 2)[2].strip(), "",
             f"Output lengths (Keel {formats[0]}, greedy, eos on): mean {statistics.mean(lengths.values()):.1f}, "
             f"min {min(lengths.values())}, max {max(lengths.values())} over {len(lengths)} requests.", "",
             "## Keel", "", head]
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
    lines += ["", "## Peers (alone, same prompts, Keel's lengths)", "", head]
    for (name, d), r in peers.items():
        lines.append(f"| {name} | {d} | {PEER_CLIENTS[name]} | {r.row()} |")
    lines += ["", "## Against the targets", ""]
    full = {k: v for k, v in peers.items() if len(v.tokens) == len(jobs)}
    hf = {k: v for k, v in full.items() if not k[0].startswith("llama-cpp")}
    targets = [("best transformers peer", hf, 1.5)]
    if ("llama-cpp-batched", "q4_1") in full:
        targets.append(("llama.cpp batched decoding", {k: full[k] for k in [("llama-cpp-batched", "q4_1")]}, 1.2))
    for label, group, target in targets:
        if not group or 16 not in concurrency:
            continue
        (bname, bd), best = max(group.items(), key=lambda kv: kv[1].tok_s)
        for d in formats:
            r = keel_res[d][("mesh", 16)]
            lines.append(f"- 16 clients through the mesh, {d}: {r.tok_s:.1f} tok/s vs {label}, {bname} {bd} "
                         f"{best.tok_s:.1f} tok/s = **{r.tok_s / best.tok_s:.2f}x** (target {target}x)")
    single = ((("llama-cpp", "q4_1"), "llama.cpp single stream", {"mesh": 1.0, "stage": 1.2}),
              (("hf-batch1", "float32"), "HF generate float32 at batch 1", {"mesh": 1.5}))
    for key, label, wanted in single:
        if key not in peers or 1 not in concurrency:
            continue
        ref = peers[key]
        for d in formats:
            for path, target in wanted.items():
                r = keel_res[d][(path, 1)]
                where = "through the mesh" if path == "mesh" else "to the inference stage alone"
                lines.append(f"- one client {where}, {d}: {r.tok_s:.1f} tok/s vs {label} "
                             f"{ref.tok_s:.1f} tok/s on the same {len(ref.tokens)} requests = "
                             f"**{r.tok_s / ref.tok_s:.2f}x** (target {target}x)")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 48, 96, 160])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--formats", type=lambda s: s.split(","), default=["gguf"])
    ap.add_argument("--peers", type=lambda s: [p for p in s.split(",") if p], default=list(PEER_CLIENTS))
    ap.add_argument("--write", type=Path)
    ap.add_argument("--peer-child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.peer_child:
        peer_child(args.peer_child)
        return 0
    jobs = workload(args.requests, args.max_tokens)
    keel_res = {}
    for d in args.formats:
        print(f"keel {d}", flush=True)
        keel_res[d] = keel(d, jobs, args.concurrency)
    lengths = keel_res[args.formats[0]][("stage", max(args.concurrency))].tokens
    peers: dict[tuple[str, str], Result] = {}
    for name in args.peers:
        for d in (("q4_1",) if name.startswith("llama-cpp") else ("float32", "bfloat16")):
            peers[(name, d)] = run_peer(name, d, subset(jobs, 1) if name in SINGLE_STREAM else jobs, lengths)
            print(f"  {name} {d}: {peers[(name, d)].tok_s:.1f} tok/s", flush=True)
    cmd = " ".join([".venv/bin/python", "-m", "bench.bench_serving"] + sys.argv[1:])
    out = report(jobs, args.concurrency, args.formats, keel_res, peers, lengths, cmd)
    print(out)
    if args.write:
        args.write.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
