"""Fuzzed HTTP requests against the whole mesh's HTTP stage: no answer >= 500, every error in
OpenAI's shape (issue 44).

Run: .venv/bin/python -m bench.bench_fuzz [--requests 10000] [--clients 8] [--seed 44] [--threads 1]

Starts `python -m keelctl up` on free loopback ports (the real model, testing/mesh.py), then draws
``--requests`` requests from the strategies of tests/openai/test_fuzz.py (bodies, headers,
x-keel-deadline-ms; half the bodies its well-typed ones naming the served model, so that they reach
the model), with a method and a path drawn here as well (the stage's routes, unknown and
odd ones) and a key that is missing, wrong or the development key (keelctl/ask.py), and sends them
from ``--clients`` threads, one connection per request. Counts the statuses; prints every answer
>= 500 with the request that produced it, and every error whose body is not OpenAI's error object.
A 504 on a caller's deadline under 5 s is counted apart (the caller asked for too little time;
tests/openai/test_fuzz.py's ``short``). A count, not a timing: the host's load does not change it.
Exit status 1 if any answer >= 500 (other than those 504s) or any error out of shape.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from bench.lib.machine import machine_line
from keelctl.ask import DEV_API_KEY
from shared.modelfile import model_id
from testing.mesh import start_mesh, stop_mesh
from tests.openai.test_fuzz import bodies, deadlines, headers, plausible, send, short

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/models/x", "/tokenize",
          "/detokenize", "/health")
PATHS = st.one_of(st.sampled_from(ROUTES), st.sampled_from(ROUTES), st.sampled_from(ROUTES),
                  st.sampled_from(("/", "/v1", "/v1/", "/v1//chat/completions", "/v1/chat/completions/",
                                   "/v1/models/" + "m" * 5000, "/%00", "/v1/%2e%2e/health", "/..%2f..%2fetc",
                                   "/v1/chat/completions?stream=true", "*")),
                  st.from_regex(r"/[A-Za-z0-9._~%/?=&-]{0,60}", fullmatch=True))
METHODS = st.one_of(st.just("POST"), st.just("POST"), st.just("GET"),
                    st.sampled_from(("PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT", "FOO")))
# The test's well-typed bodies naming the served model: these reach the model.
SERVED = plausible.map(lambda v: json.dumps({**v, "model": model_id()}).encode())
BODIES = st.sampled_from([bodies, SERVED]).flatmap(lambda s: s)  # half each (one_of would flatten `bodies`)
# Most requests go where bodies are read (POST to a body route); the rest anywhere, any method.
TARGETS = st.one_of(st.tuples(st.just("POST"), st.sampled_from(ROUTES[:3] + ROUTES[5:7])),
                    st.tuples(st.just("POST"), st.sampled_from(ROUTES[:2])), st.tuples(METHODS, PATHS))
KEYS = st.sampled_from([{}, {"x-api-key": DEV_API_KEY}, {"authorization": f"Bearer {DEV_API_KEY}"},
                        {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}])
DEADLINES = st.one_of(st.none(), st.none(), st.integers(1000, 3_600_000).map(str), deadlines)


def draw(n: int, seed_: int) -> list[dict]:
    """``n`` requests from the strategies above (hypothesis' generation phase only, seeded)."""
    drawn: list[dict] = []

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(target=TARGETS, body=BODIES, extra=headers, key=KEYS, deadline=DEADLINES)
    def collect(target, body, extra, key, deadline):
        method, path = target
        hdrs = {**extra, **key}
        if deadline is not None:
            hdrs["x-keel-deadline-ms"] = deadline
        drawn.append({"method": method, "path": path, "body": body, "headers": hdrs, "deadline": deadline})

    collect()
    return drawn


def out_of_shape(status: int, payload: bytes, method: str) -> str | None:
    """Why an error's body is not OpenAI's error object (None if it is)."""
    if status < 400 or method == "HEAD":
        return None
    try:
        error = json.loads(payload)["error"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"not an error object: {exc!r}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} or not error["code"]:
        return f"error object out of shape: {error!r}"
    return None


def code_of(r: dict) -> str:
    try:
        return f"{r['status']} {json.loads(r['payload'])['error']['code']}"
    except (ValueError, KeyError, TypeError):
        return f"{r['status']} -"


def one(url: str, req: dict) -> dict:
    start = time.perf_counter()
    try:
        status, payload, _ = send(url, req["path"], req["body"], req["headers"], method=req["method"],
                                       timeout_s=300)
    except Exception as exc:  # a refused connection, a reset, a client-side timeout: recorded as such
        return {**req, "status": f"client {type(exc).__name__}", "payload": repr(exc).encode(),
                "s": time.perf_counter() - start}
    return {**req, "status": status, "payload": payload, "s": time.perf_counter() - start,
            "shape": out_of_shape(status, payload, req["method"])}


def show(r: dict) -> str:
    hdrs = {k: v[:80] for k, v in r["headers"].items()}
    return (f"  {r['status']}: {r['method']} {r['path'][:120]!r} headers={hdrs} "
            f"body={r['body'][:300]!r}\n    answer: {r['payload'][:400]!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--threads", type=int, help="the inference stage's intra-op threads (config: one per core)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    requests = draw(args.requests, args.seed)
    print(f"drew {len(requests)} requests in {time.perf_counter() - t0:.0f} s", flush=True)
    extra = {"KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": str(args.threads)} if args.threads else {}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = start_mesh(Path(tmp), extra_env=extra)
        try:
            url = f"http://{mesh.http}"
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                results = list(pool.map(lambda r: one(url, r), requests))
            took = time.perf_counter() - t0
            tracebacks = sum((Path(tmp) / "var" / "log" / name).read_text().count("Traceback")
                             for name in os.listdir(Path(tmp) / "var" / "log") if name.startswith("openai"))
        finally:
            stop_mesh(mesh)
    statuses = Counter(r["status"] for r in results)
    late = [r for r in results if r["status"] == 504 and short(r["deadline"])]
    bad = [r for r in results if not isinstance(r["status"], int) or (r["status"] >= 500 and r not in late)]
    shapes = [r for r in results if r.get("shape")]
    print(f"{len(results)} requests from {args.clients} clients in {took:.0f} s (seed {args.seed})")
    print("statuses: " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items(), key=lambda x: str(x[0]))))
    print(f">= 500 (or no answer): {len(bad)}; 504 on a caller's deadline under 5 s (counted apart): {len(late)}; "
          f"errors out of OpenAI's shape: {len(shapes)}; tracebacks in the HTTP stage's log: {tracebacks}")
    codes = Counter(code_of(r) for r in results if isinstance(r["status"], int) and r["status"] >= 400)
    print("error codes (most common 15): " + ", ".join(f"{c}: {n}" for c, n in codes.most_common(15)))
    for r in bad[:20]:
        print(show(r))
    for r in shapes[:20]:
        print(show(r) + f"\n    {r['shape']}")
    print(machine_line())
    return 1 if bad or shapes else 0


if __name__ == "__main__":
    sys.exit(main())
