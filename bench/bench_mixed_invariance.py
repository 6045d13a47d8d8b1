"""Batch invariance through the HTTP API with the new request kinds mixed in: plain greedy chat,
forced tool calls, echo scoring (prompt logprobs) and sampled `n`=2 choices. Each request is sent
alone first (one at a time), then all of them at once (--clients at a time, so rows of every kind
share batches); a request's answer must be the same both ways: text, each call's name and arguments
(not its id, which the gateway draws), every logprob, every choice.

The whole mesh runs (`keel up` on free ports, engine.format as --format with formats.force).
Run: .venv/bin/python -m bench.bench_mixed_invariance [--requests 200] [--clients 16] [--format gguf]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

from bench.bench_inference import machine
from keelctl.ask import DEV_API_KEY
from services.inference.formats.gateprompts import SUBJECTS
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh

KINDS = ("plain", "tool", "echo", "n2")
TOOL = {"type": "function", "function": {"name": "describe", "parameters": {
    "type": "object", "properties": {"place": {"type": "string"}, "stars": {"type": "integer"}},
    "required": ["place", "stars"], "additionalProperties": False}}}


def request(i: int) -> tuple[str, dict]:
    subject, kind = SUBJECTS[i % len(SUBJECTS)], KINDS[i % len(KINDS)]
    chat = {"model": model_id(), "messages": [{"role": "user", "content": f"Tell me about {subject}."}],
            "max_tokens": 16, "temperature": 0}
    if kind == "plain":
        return "/v1/chat/completions", chat
    if kind == "tool":
        return "/v1/chat/completions", {**chat, "max_tokens": 60, "tools": [TOOL], "tool_choice": "required"}
    if kind == "echo":
        return "/v1/completions", {"model": model_id(), "prompt": f"{subject} is", "echo": True, "logprobs": 2,
                                   "max_tokens": 4, "temperature": 0}
    return "/v1/chat/completions", {**chat, "n": 2, "temperature": 0.8, "seed": i}


def essence(body: dict) -> str:
    """What must not depend on the batch: every choice's text, calls (name, arguments) and logprobs."""
    out = []
    for c in body["choices"]:
        msg = c.get("message") or {}
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or ()]
        out.append([c.get("text", msg.get("content")), calls, c.get("logprobs"), c["finish_reason"]])
    return json.dumps([out, body.get("system_fingerprint")], sort_keys=True)


async def run(http: str, n: int, clients: int) -> list[str]:
    results: list[str] = [""] * n
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker(session: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            path, body = request(i)
            r = await session.post(path, json=body)
            results[i] = essence(r.json()) if r.status_code == 200 else f"HTTP {r.status_code} {r.text[:200]}"

    async with httpx.AsyncClient(base_url=f"http://{http}", timeout=900, headers={
            "authorization": f"Bearer {DEV_API_KEY}", "x-keel-deadline-ms": "900000"}) as session:
        await asyncio.gather(*(worker(session) for _ in range(clients)))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--format", default="gguf")
    args = ap.parse_args(argv)
    mesh = start_mesh(Path(tempfile.mkdtemp(prefix="keel-mixed-")),
                      extra_env={"KEEL_INFERENCE_ENGINE__FORMAT": args.format, "KEEL_INFERENCE_FORMATS__FORCE": "true"})
    try:
        alone = asyncio.run(run(mesh.http, args.requests, 1))
        mixed = asyncio.run(run(mesh.http, args.requests, args.clients))
    finally:
        stop_mesh(mesh)
    same = [a == b and not a.startswith("HTTP") for a, b in zip(alone, mixed)]
    per_kind = {k: f"{sum(s for i, s in enumerate(same) if KINDS[i % 4] == k)}/{len(same[j::4])}"
                for j, k in enumerate(KINDS)}
    for i, ok in enumerate(same):
        if not ok:
            print(f"request {i} ({KINDS[i % 4]}) differs:\n  alone {alone[i][:300]}\n  mixed {mixed[i][:300]}")
    print(json.dumps({"requests": args.requests, "clients": args.clients, "format": args.format,
                      "identical": f"{sum(same)}/{len(same)}", "per_kind": per_kind, "machine": machine()}))
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
