"""Container health check: exit 0 only while a Keel stage answers SERVING on grpc.health.v1 (or,
for an HTTP stage, with 200 on its health path).

Copied into every stage image as /app/healthcheck.py; docker-compose.yml runs it as

    python /app/healthcheck.py --port 50052 --service keel.tokenizer.v1.Tokenizer
    python /app/healthcheck.py --port 8080 --http /health

Exit status: 0 SERVING; 1 an answer other than SERVING (warming up, draining, breaker open, or a
service name the server does not know); 2 no answer (refused, timed out). Kubernetes does not use
this file: its probes speak grpc.health.v1 natively. Health RPCs need no mesh credential (the
server interceptor exempts them), so none is sent.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, NOT_SERVING, NO_ANSWER = 0, 1, 2


def check(target: str, service: str, timeout_s: float) -> tuple[int, str]:
    """(exit status, what was seen) for one Check call."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:  # the server is up but does not know the name
            return NOT_SERVING, "SERVICE_UNKNOWN"
        return NO_ANSWER, exc.code().name
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return (SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING), status


def check_http(target: str, path: str, timeout_s: float) -> tuple[int, str]:
    """(exit status, what was seen) for one GET of an HTTP stage's health path."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{target}{path}", timeout=timeout_s) as resp:
            return SERVING, str(resp.status)
    except urllib.error.HTTPError as exc:
        return NOT_SERVING, str(exc.code)
    except OSError as exc:
        return NO_ANSWER, type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--service", default="", help='grpc health service name; "" is the whole server')
    ap.add_argument("--http", metavar="PATH", help="an HTTP stage: GET this path instead of grpc.health.v1")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = ap.parse_args(argv)
    target = f"{args.host}:{args.port}"
    if args.http:
        code, seen = check_http(target, args.http, args.timeout)
        print(f"GET {args.http}: {seen}")
        return code
    code, seen = check(target, args.service, args.timeout)
    print(f"{args.service or '(server)'}: {seen}")
    return code


if __name__ == "__main__":
    sys.exit(main())
