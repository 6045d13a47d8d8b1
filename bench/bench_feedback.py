"""The feedback loop's costs, each against a peer in the same run.

Run: .venv/bin/python -m bench.bench_feedback [--submits 3000] [--concurrency 16] [--rate 500]
     [--requests 2000] [--sections record,store,gateway] [--backends sqlite,postgresql]
     [--forwarding coalesced,per-item] [--loadgen python,native] [--open-runs N]

1. SubmitFeedback through the gateway of a real mesh (`keel up`, the real model), on the embedded
   SQLite and then on a real PostgreSQL (Debian's server, started here), two ways:
   "closed": `--submits` upserts from `--concurrency` clients each sending its next as soon as
   its last is answered (the most the mesh does; latency there is mostly queueing behind the
   other clients); "open": `--submits` upserts sent at a fixed `--rate` per second whatever the
   answers do, each latency counted from its scheduled send time (so a stall is not hidden by
   sending less during it). Peers: the gateway's own Generate of one token, the cheapest call
   that crosses the same gateway, measured in the same mesh; and the forwardings named in
   `--forwarding`, a mesh each, all up at once, their open-loop windows alternating:
   "coalesced" (the default: concurrent calls share batches, services/gateway/submits.py) and
   "per-item" (every SubmitFeedback sent on alone: the forwarding before coalescing).
   "items per batch" counts the gateway's `gateway/SubmitBatch` spans in each open window;
   "host probe ms" times a fixed loop just before it (the machine's speed then).
   `--loadgen` names the open-loop senders, their windows alternating on each mesh: "python" (this
   process, grpc.aio) and "native" (bench/lib/loadgen/submit_loadgen.cc, the same calls from C++ at about
   half the CPU, so the sender takes less of the cores the mesh runs on); "client CPU"
   is the sender's own CPU per submit.
2. The replay record's cost added to a request: the gateway's Pipeline in-process over instant
   upstreams (testing/upstreams.py's scripted ones: no model, so the record's share is
   not hidden in generation time), recording off vs on, alternating, in one run. "On" hands each
   answer to a ReplayRecorder whose worker builds the records and sends them to a real feedback
   stage process on the same event loop, so the off-path work is counted where it competes.
3. The database write alone (`--sections store`), in-process on SQLite and on a real PostgreSQL:
   the store's upsert (its own driver connection, services/feedback/upsert.py) against the same
   batch through SQLAlchemy's pool and Core, in batches of 1, 2 and 16 items.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.lib import native_loadgen
from bench.lib.feedback_store import store_section
from bench.lib.machine import machine_line
from bench.lib.openloop import at_rate
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl import health
from keelctl.ask import DEV_API_KEY, build_request
from keelctl.trace import iter_spans
from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.recording import LazyStub, ReplayConfig, ReplayRecorder
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.values import Call
from testing.mesh import start_mesh, stop_mesh
from testing.ports import free_port
from testing.postgres import PgServer
from testing.upstreams import FakeUpstreams, no_sleep

ROOT = Path(__file__).resolve().parent.parent

MD = (("x-api-key", DEV_API_KEY),)
NO_RATE_LIMIT = "{rate_per_s: 1000000, burst: 1000000}"


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


async def submit_load(target: str, trace_id: str, n: int, concurrency: int,
                      tag: str) -> tuple[float, list[float], int]:
    """(wall s, per-call ms, errors) of n SubmitFeedback upserts, each a new feedback_id (``tag`` in it)."""
    lat: list[float] = []
    errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for i in range(concurrency):  # warm the connection and the database
            await stub.SubmitFeedback(gateway_pb2.SubmitFeedbackRequest(
                trace_id=trace_id, feedback_id=f"warm-{tag}-{i}", error_type="fact_error", severity="severe"),
                metadata=MD)

        async def worker(w: int) -> None:
            nonlocal errors
            while not queue.empty():
                i = queue.get_nowait()
                item = gateway_pb2.SubmitFeedbackRequest(trace_id=trace_id, feedback_id=f"b-{tag}-{w}-{i}",
                                                         error_type="fact_error",
                                                 severity="severe", expected_keywords=["Paris"], comment="bench")
                t0 = time.perf_counter()
                try:
                    await stub.SubmitFeedback(item, metadata=MD, timeout=30)
                except grpc.aio.AioRpcError:
                    errors += 1
                lat.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return time.perf_counter() - t0, lat, errors


async def submit_open(target: str, trace_id: str, n: int, rate: float, tag: str) -> tuple[float, list[float], int]:
    """(wall s, per-call ms from the scheduled send time, errors) of n upserts sent at ``rate``/s."""
    lat: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for i in range(16):  # warm the connection and the database
            await stub.SubmitFeedback(gateway_pb2.SubmitFeedbackRequest(
                trace_id=trace_id, feedback_id=f"open-warm-{tag}-{i}", error_type="fact_error", severity="severe"),
                metadata=MD)

        async def one(i: int, due: float) -> None:
            nonlocal errors
            item = gateway_pb2.SubmitFeedbackRequest(trace_id=trace_id, feedback_id=f"o-{tag}-{i}",
                                                     error_type="fact_error", severity="severe",
                                                     expected_keywords=["Paris"], comment="bench")
            try:
                await stub.SubmitFeedback(item, metadata=MD, timeout=30)
            except grpc.aio.AioRpcError:
                errors += 1
            lat.append((time.perf_counter() - due) * 1e3)
        t0 = await at_rate(one, n, rate)
        return time.perf_counter() - t0, lat, errors


def generate_ms(target: str, n: int) -> list[float]:
    out = []
    with grpc.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for i in range(n):
            t0 = time.perf_counter()
            stub.Generate(build_request("What is the capital of France?", max_tokens=1), metadata=MD, timeout=60)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def stage_cpu_ms(mesh, stage: str) -> float:
    """CPU time (user + system, ms) used so far by the mesh's processes of ``stage`` (Linux /proc)."""
    total = 0.0
    for proc in mesh.state()["processes"].values():
        if proc["stage"] == stage and proc["pid"]:
            fields = Path(f"/proc/{proc['pid']}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    return total


def with_cpu(mesh, n: int, run) -> tuple:
    """``run()``'s result plus the gateway's and the feedback stage's CPU ms per submit during it:
    a figure that other work on the machine slows less than latency."""
    before = {s: stage_cpu_ms(mesh, s) for s in ("gateway", "feedback")}
    result = run()
    return result, {s: (stage_cpu_ms(mesh, s) - before[s]) / n for s in before}


# per-item: one item per SubmitBatch call and up to 64 calls in flight, as the forwarding before
# coalescing sent each SubmitFeedback on at once (one call in flight would serialise them).
FORWARDING = {"per-item": {"KEEL_GATEWAY_REPLAY__SUBMIT_BATCH": "1", "KEEL_GATEWAY_REPLAY__SUBMIT_INFLIGHT": "64"},
              "coalesced": {}}


@dataclass
class Window:
    """One load run on a mesh: what the load generator saw, and the stages' CPU per submit."""
    client: str  # the load generator: python | native
    mode: str  # closed | open
    offered: str
    wall_s: float
    lat_ms: list[float]
    errors: int
    cpu: dict[str, float]  # stage -> CPU ms per submit ("client": the load generator's)
    per_batch: float | None = None  # items per batch the gateway sent (open windows)
    probe_ms: float | None = None  # host_probe_ms() before it (open windows)


def batches_sent(mesh) -> tuple[int, int]:
    """(batches, items) the mesh's gateway has sent to the feedback stage so far, from its spans."""
    spans = [s for s in iter_spans(mesh.tmp / "traces", '"gateway/SubmitBatch"', "gateway-*.jsonl")
             if s["name"] == "gateway/SubmitBatch"]
    return len(spans), sum(s["attributes"].get("items", 0) for s in spans)


def host_probe_ms() -> float:
    """Wall ms of a fixed loop (a sum over a range) while the meshes are idle: how fast this
    (shared, virtual) machine runs at the moment; the same code's latency moves with it."""
    t0 = time.perf_counter()
    sum(range(2_000_000))
    return (time.perf_counter() - t0) * 1e3


def python_client(run):
    """``run()``'s result with this process's CPU ms during it added: the Python sender's."""
    cpu0 = time.process_time()
    result = run()
    return (*result, (time.process_time() - cpu0) * 1e3)


def closed_window(mesh, trace_id: str, args, tag: str) -> Window:
    (wall, lat, errors, client), cpu = with_cpu(mesh, args.submits, lambda: python_client(lambda: asyncio.run(
        submit_load(mesh.gateway, trace_id, args.submits, args.concurrency, tag))))
    return Window("python", "closed", f"{args.concurrency} clients", wall, lat, errors,
                  {**cpu, "client": client / args.submits})


def open_window(mesh, trace_id: str, args, client: str, tag: str) -> Window:
    """One open-loop window from the sender ``client`` with the host probe before it, the CPU per
    submit and the gateway's items per batch in it."""
    probe = host_probe_ms()
    sent = batches_sent(mesh)
    if client == "native":
        run = lambda: native_loadgen.submit_open_native(  # noqa: E731
            args.native_exe, mesh.gateway, DEV_API_KEY, trace_id, args.submits, args.rate, tag)
    else:
        run = lambda: python_client(lambda: asyncio.run(  # noqa: E731
            submit_open(mesh.gateway, trace_id, args.submits, args.rate, tag)))
    (wall, lat, errors, client_ms), cpu = with_cpu(mesh, args.submits, run)
    time.sleep(0.5)  # the gateway's span exporter writes every 200 ms
    now = batches_sent(mesh)
    return Window(client, "open", f"{args.rate:g}/s", wall, lat, errors, {**cpu, "client": client_ms / args.submits},
                  (now[1] - sent[1]) / max(1, now[0] - sent[0]), probe)


def gateway_section(backend: str, forwardings: list[str], args, extra_env: dict) -> list[str]:
    """A mesh per forwarding, all up at once; their open-loop windows alternate, so that each
    forwarding meets the machine's other work in the same minutes."""
    meshes, gens, trace_ids = {}, {}, {}
    runs: dict[str, list[Window]] = {f: [] for f in forwardings}
    try:
        for forwarding in forwardings:
            tmp = Path(tempfile.mkdtemp(prefix=f"keel-bench-fb-{backend}-"))
            mesh = meshes[forwarding] = start_mesh(tmp, extra_env={
                "KEEL_GATEWAY_RATE_LIMITS__DEFAULT": NO_RATE_LIMIT, **FORWARDING[forwarding], **extra_env})
            gens[forwarding] = generate_ms(mesh.gateway, 5)
            with grpc.insecure_channel(mesh.gateway) as ch:
                trace_ids[forwarding] = gateway_pb2_grpc.GatewayStub(ch).Generate(
                    build_request("Name a colour.", max_tokens=2), metadata=MD, timeout=60).trace_id
            runs[forwarding].append(closed_window(mesh, trace_ids[forwarding], args, forwarding))
        pairs = [(f, c) for f in forwardings for c in args.loadgen]
        for r in range(args.open_runs):
            for forwarding, client in (pairs if r % 2 == 0 else pairs[::-1]):
                runs[forwarding].append(open_window(meshes[forwarding], trace_ids[forwarding], args, client,
                                                    f"{forwarding}-{client}-{r}"))
    finally:
        for mesh in meshes.values():
            stop_mesh(mesh)

    def opt(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)
    return [f"| {backend} | {forwarding} | {w.client} | {w.mode} | {args.submits} | {w.offered} | "
            f"{args.submits / w.wall_s:.0f} | {statistics.median(w.lat_ms):.2f} | {pct(w.lat_ms, 0.99):.2f} | "
            f"{w.errors} | {opt(w.per_batch, '.2f')} | {opt(w.probe_ms, '.0f')} | {w.cpu['gateway']:.3f} | "
            f"{w.cpu['feedback']:.3f} | {w.cpu['client']:.3f} | "
            f"{statistics.median(gens[forwarding]):.1f} |"
            for forwarding in forwardings for w in runs[forwarding]]


async def record_cost(requests: int, target: str) -> tuple[list[float], list[float], float, float]:
    recorder = ReplayRecorder(ReplayConfig(), LazyStub((target,), 4 * 1024 * 1024))
    recorder.start()
    ex = RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1))
    off = Pipeline(FakeUpstreams(tokens=tuple(range(5, 37))), ex, Limits(), rng=random.Random(7))
    on = Pipeline(FakeUpstreams(tokens=tuple(range(5, 37))), ex, Limits(), rng=random.Random(7),
                  on_served=recorder.served)
    ask = Ask(messages=(("user", "What is the capital of France? " * 8),), max_tokens=32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(requests + 200):
        recording = bool(i % 2)
        t0 = time.perf_counter()
        await (on if recording else off).generate(ask, Call(time.monotonic() + 60, f"{i:032x}"))
        if i >= 200:
            times[recording].append((time.perf_counter() - t0) * 1e3)
        await asyncio.sleep(0)  # let the recorder's worker run between requests, as a server's loop would
    # Per-request wall time of a block of requests, the worker's building and sending included
    # (the "on" block ends when every record of it reached the feedback stage).
    blocks = {}
    for recording in (False, True):
        t0 = time.perf_counter()
        for i in range(requests):
            await (on if recording else off).generate(ask, Call(time.monotonic() + 60, f"b{int(recording)}{i:030x}"))
            await asyncio.sleep(0)
        if recording:
            await recorder.close()
        blocks[recording] = (time.perf_counter() - t0) * 1e3 / requests
    return times[False], times[True], blocks[False], blocks[True]


def record_section(args) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-rec-"))
    port = free_port()
    env = dict(os.environ, KEEL_VAR_DIR=str(tmp), KEEL_FEEDBACK_SERVER__PORT=str(port),
               KEEL_FEEDBACK_SERVER__METRICS_PORT="0", KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT="0",
               KEEL_TRACES_DIR=str(tmp / "traces"))
    env.pop("KEEL_MESH_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.feedback"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        health.wait_serving({"feedback": (f"127.0.0.1:{port}", "keel.feedback.v1.Feedback")}, 60)
        off, on, block_off, block_on = asyncio.run(record_cost(args.requests, f"127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(30)
    p_off, p_on = statistics.median(off), statistics.median(on)
    return (f"request p50: recording off {p_off:.3f} ms, on {p_on:.3f} ms, ratio {p_on / p_off:.2f}x, "
            f"added {p_on - p_off:.3f} ms p50; p99 off {pct(off, 0.99):.3f} ms, on {pct(on, 0.99):.3f} ms "
            f"({len(off)} + {len(on)} requests of 32 output tokens, alternating)\n"
            f"block of {args.requests} requests, wall per request incl. the worker's build + send: "
            f"off {block_off:.3f} ms, on {block_on:.3f} ms, ratio {block_on / block_off:.2f}x, "
            f"added {block_on - block_off:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--submits", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rate", type=float, default=500.0, help="submits per second of the open-loop run")
    ap.add_argument("--open-runs", type=int, default=1, help="open-loop runs, one after another on the same mesh")
    ap.add_argument("--backends", default="sqlite,postgresql", help="comma list: sqlite,postgresql")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--sections", default="record,gateway", help="comma list: record,store,gateway")
    ap.add_argument("--forwarding", default="coalesced",
                    help=f"how the gateway forwards SubmitFeedback, a comma list of {', '.join(FORWARDING)} "
                         "(both: per-item,coalesced): a mesh each, up at once, their open-loop windows alternating")
    ap.add_argument("--loadgen", default="python", type=lambda s: s.split(","),
                    help="the open-loop senders, a comma list of python, native (C++): their windows alternate")
    args = ap.parse_args()
    if unknown := set(args.loadgen) - {"python", "native"}:
        ap.error(f"--loadgen: unknown {', '.join(sorted(unknown))}")
    args.native_exe = native_loadgen.build() if "native" in args.loadgen else None
    sections = args.sections.split(",")
    if "record" in sections:
        print(record_section(args), flush=True)
    if "store" in sections:
        print(store_section(args), flush=True)
    if "gateway" not in sections:
        return 0
    print("| database | forwarding | load generator | mode | submits | offered | per s | p50 ms | p99 ms | errors | "
          "items per batch | host probe ms | gateway CPU ms/submit | feedback CPU ms/submit | client CPU ms/submit | "
          "peer: Generate(1 token) p50 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    backends = args.backends.split(",")
    forwardings = ["per-item", "coalesced"] if args.forwarding == "both" else args.forwarding.split(",")
    if unknown := set(forwardings) - set(FORWARDING):
        ap.error(f"--forwarding: unknown {', '.join(sorted(unknown))}")
    if "sqlite" in backends:
        print("\n".join(gateway_section("sqlite", forwardings, args, {})), flush=True)
    if "postgresql" in backends:
        pg = PgServer().init()
        pg.start()
        try:
            print("\n".join(gateway_section("postgresql", forwardings, args,
                                            {"KEEL_FEEDBACK_DATABASE__URL": pg.url})), flush=True)
        finally:
            pg.stop()
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
