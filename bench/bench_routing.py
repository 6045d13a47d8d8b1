"""Routing across inference replicas: the gateway's policies (round_robin, least_loaded,
prefix_affinity) on the whole mesh with 2 inference replicas x 1 thread, one fresh mesh per policy.

Run:  .venv/bin/python -m bench.bench_routing [--conversations 32] [--max-tokens 8]
          [--policies round_robin,least_loaded,prefix_affinity/approximate,prefix_affinity/precise]
          [--workloads abc] [--no-single] [--prefix-cache-mb N]
A policy may name its routing.mode after a slash (precise: the replicas' WatchCache streams feed
the index and loads); without one it runs approximate, the gateway's own record and counts.

Workloads, in this order on each mesh (one warm-up request first):
  a  conversations: --conversations of 4-6 turns over 4 shared system prompts of ~600 tokens, 4
     clients at once; each turn sends the whole history (system, earlier turns and answers)
  b  the same number of requests, each with its own ~600-token system prompt (nothing shared)
  c  one hot prompt (~600 tokens) sent by 16 clients, 2 requests each (the imbalance case)
Per workload and policy: TTFT p50/p90 (GenerateStream call to the first delta), tokens/s
(completion tokens / wall time), the prefix hit rate (hit tokens / prompt tokens looked up, from
each replica's keel_inference_prefix_cache_*_tokens_total, summed) and the share of requests per
replica. Also workload a on a single replica (its hit rate: what affinity should approach) and the
gateway's CPU seconds per request (psutil), the ratio the issue's CPU target is about.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl.ask import DEV_API_KEY
from testing.mesh import start_mesh, stop_mesh

WORDS = ("river stone cloud lamp paper garden window silver morning engine harbor violet circle "
         "forest ladder copper signal meadow lantern marble orbit canvas summit willow").split()
QUESTIONS = ("What should I do next?", "Summarise that in one line.", "Why?", "Give an example.",
             "And the opposite?", "Say it more simply.")
COUNTERS = ("keel_inference_prefix_cache_prompt_tokens", "keel_inference_prefix_cache_hit_tokens")


def system_prompt(seed: int, words: int = 420) -> str:
    """About 600 tokens of text (SmolLM2's tokenizer: ~1.4 tokens per word here)."""
    g = random.Random(seed)
    return f"You are assistant {seed}. " + " ".join(g.choice(WORDS) for _ in range(words))


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    failed: int = 0
    hit_rate: float = 0.0
    per_replica: list[float] = field(default_factory=list)
    gateway_cpu_per_request_ms: float = 0.0

    def row(self, policy: str, workload: str) -> str:
        q = statistics.quantiles(self.ttft, n=10) if len(self.ttft) > 1 else [self.ttft[0]] * 9
        share = "/".join(f"{s:.2f}" for s in self.per_replica)
        return (f"| {workload} | {policy} | {statistics.median(self.ttft) * 1000:.0f} | {q[8] * 1000:.0f} | "
                f"{self.tokens / self.wall:.1f} | {self.hit_rate:.2f} | {share} | "
                f"{self.gateway_cpu_per_request_ms:.2f} | "
                f"{self.failed} |")


def scrape(ports: list[int]) -> list[dict[str, float]]:
    out = []
    for port in ports:
        url = f"http://127.0.0.1:{port}/metrics"  # a replica of the mesh this bench started, on loopback
        body = urllib.request.urlopen(url, timeout=10).read().decode()  # nosec B310
        values = {name: 0.0 for name in COUNTERS}
        for family in text_string_to_metric_families(body):
            if family.name in values:
                values[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        out.append(values)
    return out


async def stream(stub, messages: list[tuple[str, str]], max_tokens: int, res: Result) -> str:
    req = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0))
    start, first, text = time.perf_counter(), None, []
    try:
        async for ev in stub.GenerateStream(req, metadata=(("x-api-key", DEV_API_KEY),), timeout=600):
            if ev.HasField("delta"):
                if first is None:
                    first = time.perf_counter()
                text.append(ev.delta)
            else:
                res.tokens += ev.done.usage.completion_tokens
    except grpc.aio.AioRpcError:
        res.failed += 1
        return ""
    res.ttft.append((first or time.perf_counter()) - start)
    return "".join(text)


def conversations(n: int) -> list[list[str]]:
    g = random.Random(7)
    return [[system_prompt(i % 4)] + [g.choice(QUESTIONS) for _ in range(g.randint(4, 6))] for i in range(n)]


async def workload_a(stub, convs: list[list[str]], max_tokens: int, res: Result, clients: int = 4) -> None:
    pending = iter(convs)

    async def client():
        for system, *turns in pending:
            history = [("system", system)]
            for question in turns:
                history.append(("user", question))
                history.append(("assistant", await stream(stub, history, max_tokens, res) or "ok"))
    await asyncio.gather(*(client() for _ in range(clients)))


async def workload_b(stub, requests: int, max_tokens: int, res: Result, clients: int = 4, seed: int = 1000) -> None:
    pending = iter(range(requests))

    async def client():
        for i in pending:
            await stream(stub, [("system", system_prompt(seed + i)), ("user", QUESTIONS[i % 6])], max_tokens, res)
    await asyncio.gather(*(client() for _ in range(clients)))


async def workload_c(stub, max_tokens: int, res: Result, clients: int = 16, each: int = 2) -> None:
    hot = [("system", system_prompt(4242)), ("user", "What should I do next?")]

    async def client():
        for _ in range(each):
            await stream(stub, hot, max_tokens, res)
    await asyncio.gather(*(client() for _ in range(clients)))


async def measure(mesh, name: str, run, pids: list[int]) -> Result:
    ports = mesh.layout["stages"]["inference"]["metrics_ports"]
    before, res = scrape(ports), Result()
    cpu0 = sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)
    async with grpc.aio.insecure_channel(mesh.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        t0 = time.perf_counter()
        await run(stub, res)
        res.wall = time.perf_counter() - t0
    cpu = sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids) - cpu0
    await asyncio.sleep(2.5)  # the replicas export their counters every second
    after = scrape(ports)
    looked = [a[COUNTERS[0]] - b[COUNTERS[0]] for a, b in zip(after, before)]
    hits = [a[COUNTERS[1]] - b[COUNTERS[1]] for a, b in zip(after, before)]
    res.hit_rate = sum(hits) / max(1.0, sum(looked))
    res.per_replica = [x / max(1.0, sum(looked)) for x in looked]
    res.gateway_cpu_per_request_ms = cpu * 1000 / max(1, len(res.ttft) + res.failed)
    print(f"  {name}: {len(res.ttft)} answers, {res.tokens / res.wall:.1f} tok/s, hit rate {res.hit_rate:.2f}",
          flush=True)
    return res


def run_policy(policy: str, replicas: int, args, workloads: str) -> dict[str, Result]:
    name, _, mode = policy.partition("/")
    env = {"KEEL_GATEWAY_ROUTING__POLICY": name, "KEEL_GATEWAY_ROUTING__MODE": mode or "approximate",
           "KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": "1", "KEEL_INFERENCE_ENGINE__MAX_BATCH_SIZE": "16"}
    if args.prefix_cache_mb is not None:
        env["KEEL_INFERENCE_ENGINE__PREFIX_CACHE_BYTES"] = str(args.prefix_cache_mb << 20)
    mesh = start_mesh(Path(tempfile.mkdtemp(prefix="keel-routing-")), inference_replicas=replicas,
                      tokenizer_workers=1, extra_env=env)
    print(f"{policy} on {replicas} replica(s): mesh up", flush=True)
    try:
        procs = mesh.state()["processes"]
        pids = [p["pid"] for n, p in procs.items() if n.startswith("gateway")]
        convs = conversations(args.conversations)
        turns = sum(len(c) - 1 for c in convs)
        mt = args.max_tokens
        out = {}

        async def all_of_them():
            await measure(mesh, "warm-up", lambda s, r: workload_b(s, 2, mt, r, clients=1, seed=9000), pids)
            if "a" in workloads:
                out["a"] = await measure(mesh, "a", lambda s, r: workload_a(s, convs, mt, r), pids)
            if "b" in workloads:
                out["b"] = await measure(mesh, "b", lambda s, r: workload_b(s, turns, mt, r), pids)
            if "c" in workloads:
                out["c"] = await measure(mesh, "c", lambda s, r: workload_c(s, mt, r), pids)
        asyncio.run(all_of_them())
        return out
    finally:
        stop_mesh(mesh)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--policies",
                    default="round_robin,least_loaded,prefix_affinity/approximate,prefix_affinity/precise")
    ap.add_argument("--workloads", default="abc")
    ap.add_argument("--no-single", action="store_true", help="skip workload a on one replica")
    ap.add_argument("--prefix-cache-mb", type=int,
                    help="each replica's prefix cache (default: config/inference.yaml's); below what workload "
                         "a's 4 shared prompts take, one replica cannot hold them all, two can")
    args = ap.parse_args()
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()[2:]
                    if f.startswith(("avx", "amx"))})
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {' '.join(flags)}; "
          f"load at start {os.getloadavg()[0]:.2f}")
    rows = {}
    for policy in args.policies.split(","):
        for w, r in run_policy(policy, 2, args, args.workloads).items():
            rows[(w, policy)] = r
    if "a" in args.workloads and not args.no_single:
        for w, r in run_policy("round_robin", 1, args, "a").items():
            rows[(w, "one replica")] = r
    print("\n| workload | policy | TTFT p50 ms | TTFT p90 ms | tok/s | hit rate | prompt tokens per replica "
          "| gateway CPU ms/request | failed |\n|---|---|---|---|---|---|---|---|---|")
    for (w, policy), r in sorted(rows.items()):
        print(r.row(policy, w))
    rr = {w: rows[(w, "round_robin")] for w in "abc" if (w, "round_robin") in rows}
    ll = {w: rows[(w, "least_loaded")] for w in "abc" if (w, "least_loaded") in rows}
    pa = {w: rows[(w, "prefix_affinity/precise")] for w in "abc" if (w, "prefix_affinity/precise") in rows}
    approx = {w: rows[(w, "prefix_affinity/approximate")] for w in "abc"
              if (w, "prefix_affinity/approximate") in rows}
    for w in sorted(set(pa) & set(approx)):
        print(f"{w}: precise / approximate: TTFT p50 "
              f"{statistics.median(pa[w].ttft) / statistics.median(approx[w].ttft):.2f}, "
              f"tok/s {pa[w].tokens / pa[w].wall / (approx[w].tokens / approx[w].wall):.2f}, "
              f"hit rate {pa[w].hit_rate:.2f} vs {approx[w].hit_rate:.2f}")
    if len(rr) == len(ll) == len(pa) == 3 and ("a", "one replica") in rows:
        one = rows[("a", "one replica")]
        print(f"\na: TTFT p50 prefix_affinity / round_robin = "
              f"{statistics.median(pa['a'].ttft) / statistics.median(rr['a'].ttft):.2f} (target <= 0.6); "
              f"hit rate / one replica's = {pa['a'].hit_rate / max(one.hit_rate, 1e-9):.2f} (target >= 0.9)")
        def tok_s(r: Result) -> float:
            return r.tokens / r.wall
        cpu = sum(pa[w].gateway_cpu_per_request_ms for w in pa) / sum(rr[w].gateway_cpu_per_request_ms for w in rr)
        print(f"b: tok/s prefix_affinity / least_loaded = {tok_s(pa['b']) / tok_s(ll['b']):.2f} (target >= 0.95)")
        print(f"c: tok/s prefix_affinity / least_loaded = {tok_s(pa['c']) / tok_s(ll['c']):.2f} (target >= 0.9)")
        print(f"gateway CPU per request, prefix_affinity / round_robin (a+b+c) = {cpu:.2f} (target <= 1.1)")
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
