"""Slowloris against the HTTP stage: its RSS and normal requests' latency while hundreds of
connections send their requests a byte at a time (issue 44), against a quiet window of the same run.

Run: .venv/bin/python -m bench.bench_slowloris [--connections 500] [--requests 200] [--gap-s 0.05]
                                               [--byte-every-s 1] [--threads 1]

Starts `python -m keelctl up` on free loopback ports (the real model, testing/mesh.py). Normal
requests: ``--requests`` 1-token greedy chat completions with the development key, one after
another, each on a new connection, ``--gap-s`` apart. Three windows of the same requests: quiet,
slowloris, quiet again (the two quiet ones pooled as the peer, so that drift in the shared host's
load shows as their difference). During the slowloris window a separate process (this module with
``--attack``) keeps ``--connections`` connections open to the HTTP stage: half send their request
line and headers one byte every ``--byte-every-s`` (no key), half send whole headers without a key
announcing a 4,000-byte body, then the body one byte at a time. A connection the stage closes is
opened again at once, so the count stays up; the attacker reports how long each one lasted before the
stage closed it (its header timeout, ``edge.header_timeout_s``, and body timeout,
``edge.body_timeout_s``: services/openai/limits.py). The HTTP stage's RSS (/proc/PID/status VmRSS)
is sampled every 0.25 s throughout, its CPU time (/proc/PID/stat) per window. Prints p50/p99 of
each window and their ratio to quiet, the RSS before, at its peak and after, the stage's and the
attacker's CPU time, the CPU flags and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.machine import machine_line
from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh

ROOT = Path(__file__).resolve().parents[1]
BODY = json.dumps({"model": model_id(), "messages": [{"role": "user", "content": "Say hello."}],
                   "max_tokens": 1, "temperature": 0}).encode()
HEADERS = {"Authorization": f"Bearer {DEV_API_KEY}", "Content-Type": "application/json"}
SLOW_BODY_BYTES = 4000  # under edge.preauth_body_bytes: the stage reads it before the key is checked


# --- the attacker (its own process) ---

async def slow_connection(host: str, port: int, slow_body: bool, every_s: float, lived: list, stop: asyncio.Event):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {SLOW_BODY_BYTES}\r\n\r\n").encode()
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(every_s)
            continue
        opened = time.monotonic()
        closed_by = "us"
        try:
            if slow_body:
                writer.write(head)
            trickle = b"{" + b" " * SLOW_BODY_BYTES if slow_body else head
            for byte in trickle:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                try:  # the stage closing shows as EOF (or a reset) on the next read
                    if await asyncio.wait_for(reader.read(1024), every_s) == b"":
                        closed_by = "stage"
                        break
                except asyncio.TimeoutError:
                    continue
        except OSError:
            closed_by = "stage"
        if closed_by == "stage":
            lived.append(("body" if slow_body else "headers", time.monotonic() - opened))
        writer.close()


async def attack(host: str, port: int, connections: int, every_s: float) -> dict:
    stop, lived = asyncio.Event(), []
    tasks = [asyncio.create_task(slow_connection(host, port, i % 2 == 1, every_s, lived, stop))
             for i in range(connections)]
    # runs until the bench closes our stdin
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    t = os.times()
    out = {"attacker_cpu_s": round(t.user + t.system, 1)}
    for kind in ("headers", "body"):
        s = sorted(t for k, t in lived if k == kind)
        out[kind] = {"closed_by_stage": len(s), "p50_s": statistics.median(s) if s else None,
                     "min_s": s[0] if s else None, "max_s": s[-1] if s else None}
    return out


# --- the bench ---

def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window(target: str, requests: int, gap_s: float) -> list[float]:
    host, port = target.split(":")
    samples = []
    for _ in range(requests):
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", BODY, HEADERS)
            resp = conn.getresponse()
            resp.read()
        finally:
            conn.close()
        samples.append(time.perf_counter() - t0)
        assert resp.status == 200, resp.status
        time.sleep(gap_s)
    return samples


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--gap-s", type=float, default=0.05)
    ap.add_argument("--byte-every-s", type=float, default=1.0)
    ap.add_argument("--threads", type=int, help="the inference stage's intra-op threads (config: one per core)")
    ap.add_argument("--attack", metavar="HOST:PORT", help="be the attacker process (the bench starts it)")
    args = ap.parse_args()
    if args.attack:
        host, port = args.attack.split(":")
        print(json.dumps(asyncio.run(attack(host, int(port), args.connections, args.byte_every_s))))
        return 0
    extra = {"KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": str(args.threads)} if args.threads else {}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp), extra_env=extra)
        try:
            pid = next(p["pid"] for p in mesh.state()["processes"].values() if p["stage"] == "openai")
            rss: list[tuple[str, int]] = []
            phase = ["warm"]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    rss.append((phase[0], rss_kb(pid)))
                    time.sleep(0.25)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            window(mesh.http, 20, args.gap_s)  # warm: the first requests compile and fill caches
            phase[0] = "quiet"
            cpu = {}  # the HTTP stage's CPU seconds and the wall seconds of each window
            c0, t0 = cpu_s(pid), time.monotonic()
            quiet = window(mesh.http, args.requests, args.gap_s)
            cpu["quiet before"] = (cpu_s(pid) - c0, time.monotonic() - t0)
            rss_before = rss[-1][1]
            attacker = subprocess.Popen([sys.executable, "-m", "bench.bench_slowloris", "--attack", mesh.http,
                                         "--connections", str(args.connections),
                                         "--byte-every-s", str(args.byte_every_s)],
                                        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            time.sleep(5)  # the connections open
            phase[0] = "slowloris"
            c0, t0 = cpu_s(pid), time.monotonic()
            loud = window(mesh.http, args.requests, args.gap_s)
            cpu["slowloris"] = (cpu_s(pid) - c0, time.monotonic() - t0)
            attacker.stdin.close()
            lived = json.loads(attacker.stdout.read())
            attacker.wait(60)
            phase[0] = "after"
            time.sleep(2)
            c0, t0 = cpu_s(pid), time.monotonic()
            quiet2 = window(mesh.http, args.requests, args.gap_s)
            cpu["quiet after"] = (cpu_s(pid) - c0, time.monotonic() - t0)
            done.set()
            sampler.join()
            log = "".join(p.read_text() for p in (Path(tmp) / "var" / "log").glob("openai*.log"))
            closes = {what: log.count(f"did not send its request's {what} in time") for what in ("headers", "body")}
        finally:
            stop_mesh(mesh)
    peak = max(kb for ph, kb in rss if ph == "slowloris")
    calm = quiet + quiet2
    print(f"normal requests: {args.requests} per window, 1-token chat completions, a new connection each, "
          f"{args.gap_s} s apart; slowloris: {args.connections} connections, a byte every {args.byte_every_s} s")
    print("| window | p50 ms | p99 ms | p50 / quiet | p99 / quiet |")
    print("|---|---|---|---|---|")
    for name, s in (("quiet (both)", calm), ("quiet before", quiet), ("slowloris", loud), ("quiet after", quiet2)):
        print(f"| {name} | {pct(s, 0.5):.1f} | {pct(s, 0.99):.1f} | {pct(s, 0.5) / pct(calm, 0.5):.2f} "
              f"| {pct(s, 0.99) / pct(calm, 0.99):.2f} |")
    print("the HTTP stage's CPU: " + "; ".join(f"{w} {c:.1f} s in {t:.0f} s ({c / t:.0%} of a core)"
                                                 for w, (c, t) in cpu.items()))
    print(f"HTTP stage RSS: {rss_before / 1024:.1f} MB before, {peak / 1024:.1f} MB peak during slowloris "
          f"(+{(peak - rss_before) / 1024:.1f} MB), {rss[-1][1] / 1024:.1f} MB after")
    print(f"slow connections the stage closed (attacker's view): {json.dumps(lived)}")
    print(f"the stage's log: {closes['headers']} closed for headers not sent in time, {closes['body']} for the body")
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
