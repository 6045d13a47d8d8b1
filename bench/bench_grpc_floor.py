"""What a gRPC call costs in Python on this machine with nothing of Keel in it: the floor under
the gateway's CPU per SubmitFeedback.

Run: .venv/bin/python -m bench.bench_grpc_floor [--calls 3000] [--rate 500] [--rounds 2]

A bare grpc.aio server in a fresh process (no interceptor, no spans, no auth) answers each
message at once: a unary method with the public SubmitFeedback types (the call a client makes to
the gateway) and a bidirectional stream with the SubmitStream types (the gateway's batches to the
feedback stage: one message each way per batch, answered in order). This process sends `--calls`
of each at a fixed `--rate` (open loop, latency from the scheduled send time), unary and stream
rounds alternating. Reported per call or message: the server process's CPU (user + system, from
/proc), this client's CPU, p50 and p99. A SubmitFeedback through the mesh pays one unary call
(client and server side) plus, per batch, one stream message (the gateway's client side and the
feedback stage's server side); bench/bench_feedback.py measures the mesh itself.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.lib.machine import machine_line
from bench.lib.openloop import at_rate
from keel.feedback.v1 import feedback_pb2
from keel.gateway.v1 import gateway_pb2
from testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent

UNARY, STREAM = "/floor.Floor/Unary", "/floor.Floor/Stream"
WARM = 50  # calls before the measured ones (the server's CPU figure counts them as calls too)


async def serve(port: int) -> None:
    async def unary(request, context):
        return gateway_pb2.SubmitFeedbackResponse(feedback_id=request.feedback_id, created=True)

    async def stream(requests, context):
        async for request in requests:
            yield feedback_pb2.SubmitStreamResponse(results=[
                feedback_pb2.SubmitResult(feedback_id=i.feedback_id, created=True) for i in request.items])
    handlers = grpc.method_handlers_generic_handler("floor.Floor", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, gateway_pb2.SubmitFeedbackRequest.FromString,
                                                     gateway_pb2.SubmitFeedbackResponse.SerializeToString),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, feedback_pb2.SubmitStreamRequest.FromString,
                                                        feedback_pb2.SubmitStreamResponse.SerializeToString)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    gc.collect()
    gc.freeze()
    await server.wait_for_termination()


def item(i: int) -> feedback_pb2.SubmitRequest:
    return feedback_pb2.SubmitRequest(trace_id="a" * 32, feedback_id=f"f-{i}", error_type="fact_error",
                                      severity="severe", expected_keywords=["Paris"], comment="bench")


async def load(target: str, mode: str, calls: int, rate: float) -> tuple[list[float], float]:
    """Latencies (ms) of ``calls`` sent at ``rate``, and this process's CPU ms per call."""
    lat: list[float] = []
    async with grpc.aio.insecure_channel(target) as ch:
        unary = ch.unary_unary(UNARY, gateway_pb2.SubmitFeedbackRequest.SerializeToString,
                               gateway_pb2.SubmitFeedbackResponse.FromString)
        if mode == "unary":
            async def one(i: int, due: float) -> None:
                await unary(gateway_pb2.SubmitFeedbackRequest(trace_id="a" * 32, feedback_id=f"f-{i}",
                                                              error_type="fact_error", severity="severe"))
                lat.append((time.perf_counter() - due) * 1e3)
        else:
            call = ch.stream_stream(STREAM, feedback_pb2.SubmitStreamRequest.SerializeToString,
                                    feedback_pb2.SubmitStreamResponse.FromString)()
            waiting: asyncio.Queue[float] = asyncio.Queue()
            writing = asyncio.Lock()

            async def read() -> None:
                async for _ in call:
                    lat.append((time.perf_counter() - waiting.get_nowait()) * 1e3)
            reader = asyncio.create_task(read())

            async def one(i: int, due: float) -> None:
                async with writing:  # one pending write per call, as the gateway's SubmitStream
                    waiting.put_nowait(due)
                    await call.write(feedback_pb2.SubmitStreamRequest(items=[item(i)]))
        for i in range(WARM):  # warm the connection
            await one(i, time.perf_counter())
        while len(lat) < WARM:
            await asyncio.sleep(0.01)
        lat.clear()
        c0 = time.process_time()
        await at_rate(one, calls, rate)
        while len(lat) < calls:
            await asyncio.sleep(0.001)
        cpu = (time.process_time() - c0) * 1e3 / calls
        if mode == "stream":
            await call.done_writing()
            await reader
    return lat, cpu


def process_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's own entry
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", __spec__.name, "--serve", str(port)])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
        print("| round | call | per s offered | server CPU ms/call | client CPU ms/call | p50 ms | p99 ms |")
        print("|---|---|---|---|---|---|---|", flush=True)
        for r in range(args.rounds):
            for mode in ("unary", "stream"):
                s0 = process_cpu_ms(server.pid)
                lat, client_cpu = asyncio.run(load(f"127.0.0.1:{port}", mode, args.calls, args.rate))
                server_cpu = (process_cpu_ms(server.pid) - s0) / (args.calls + WARM)
                lat.sort()
                print(f"| {r + 1} | {mode} | {args.rate:g} | {server_cpu:.3f} | {client_cpu:.3f} | "
                      f"{lat[len(lat) // 2]:.2f} | {lat[int(0.99 * (len(lat) - 1))]:.2f} |", flush=True)
    finally:
        server.kill()
        server.wait()
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
