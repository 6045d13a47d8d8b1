"""The `keel` command: run the mesh and talk to it.

    keel up [--detach] [--demo]   start Redis + every stage, wait for SERVING, print where each listens
    keel down                     stop a detached mesh (drains in-flight calls)
    keel status                   health of every process of the running mesh
    keel ask "PROMPT" [--max-tokens N] [--temperature T] [--seed S] [--json]
    keel trace TRACE_ID           the whole chain of one request, across every stage's trace files
                                  (--format chrome: a Chrome Trace Event file)
    keel tokenize | detokenize    JSON lines on stdin -> stdout, in-process
    keel quarantine list|show|replay|purge ...
    keel replay TRACE_ID          re-run a recorded request; "identical" or the first differing token
    keel verify determinism [--sample N] [--since 24h]   replay a sample of recent requests
    keel feedback submit|list     report a bad answer (through the gateway); list reports
    keel etl run --since 24h --out DIR   severe factual errors -> a reproducible JSONL chat dataset
    keel certs [--out var/certs]  TLS certificates for the mesh (then KEEL_MESH_TLS_DIR=var/certs keel up)
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from keelctl import health
from shared.config import ConfigError
from keelctl.layout import LOG_DIR, ROOT, SERVICE_NAMES, STAGE_ORDER, VAR_DIR, load_layout, read_state

DEMO_PROMPT = "What is the capital of France?"


def _targets(layout) -> dict[str, tuple[str, str]]:
    return {f"{stage}@{t}": (t, SERVICE_NAMES[stage]) for stage in STAGE_ORDER for t in layout.targets(stage)}


def _print_table(layout, statuses: dict[str, str]) -> None:
    for name, st in statuses.items():
        print(f"  {name:<28} {st}")
    print(f"  redis@127.0.0.1:{layout.redis.port}")


def _gateway(layout) -> str:
    return layout.targets("gateway")[0]


def cmd_up(args) -> int:
    import logging

    from keelctl.supervisor import Supervisor
    from shared import metrics
    from shared.logging import JsonFormatter, setup_logging

    layout = load_layout()
    if args.detach:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with open(LOG_DIR / "supervisor.out", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "keelctl", "up"], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            statuses = health.wait_serving(_targets(layout), layout.ready_timeout_s, lambda: proc.poll() is None)
        except TimeoutError as exc:
            proc.terminate()  # no half-started mesh left behind
            print(f"keel up failed: {exc}; see {LOG_DIR}")
            return 1
        print(f"keel is up (supervisor pid {proc.pid}); gateway at {_gateway(layout)}")
        _print_table(layout, statuses)
        return 0

    setup_logging("supervisor")
    logging.getLogger().handlers[0].setLevel(logging.WARNING)  # the terminal gets problems only
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(LOG_DIR / "supervisor.log")
    fh.setFormatter(JsonFormatter("supervisor"))
    logging.getLogger().addHandler(fh)
    sup = Supervisor(layout)
    if layout.metrics_port:
        metrics.start_metrics_server(layout.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sup.start()
    loop = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    loop.start()
    try:
        statuses = health.wait_serving(_targets(layout), layout.ready_timeout_s, lambda: not stop.is_set())
        print(f"keel is up; gateway at {_gateway(layout)}", flush=True)
        _print_table(layout, statuses)
        if args.demo:
            from keelctl import ask
            print(f"\ndemo> {DEMO_PROMPT}", flush=True)
            ask.main(_gateway(layout), prompt=DEMO_PROMPT, max_tokens=48, temperature=0.0, seed=None, as_json=False)
            print("\nserving until Ctrl-C ...", flush=True)
        stop.wait()
    except TimeoutError as exc:
        print(f"keel up failed: {exc}; see {LOG_DIR}", flush=True)
        stop.set()
        return_code = 1
    else:
        return_code = 0
    loop.join()
    sup.stop()
    return return_code


def cmd_down(args) -> int:
    pid = read_state().get("pid")
    if not pid:
        print("keel is not running")
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print("keel is not running")
        return 0
    deadline = time.monotonic() + 240  # each stage drains its in-flight calls first
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print("keel is down")
            return 0
        time.sleep(0.2)
    print(f"supervisor {pid} did not stop within 240 s")
    return 1


def cmd_status(args) -> int:
    layout = load_layout()
    state = read_state()
    statuses = {name: health.status(t, s) for name, (t, s) in _targets(layout).items()}
    procs = state.get("processes", {})
    for name, st in statuses.items():
        print(f"  {name:<28} {st}")
    for name, p in procs.items():
        print(f"  {name:<28} pid {p.get('pid')}  restarts {p.get('restarts')}")
    return 0 if all(v == "SERVING" for v in statuses.values()) else 1


def cmd_ask(args) -> int:
    from keelctl import ask
    return ask.main(_gateway(load_layout()), prompt=args.prompt, max_tokens=args.max_tokens,
                    temperature=args.temperature, seed=args.seed, as_json=args.json, domain=args.domain)


def cmd_certs(args) -> int:
    from keelctl import certs
    print(f"certificates in {certs.make(args.out, args.days)}; start the mesh with KEEL_MESH_TLS_DIR={args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="keel", description="Run and use the Keel mesh.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the mesh")
    up.add_argument("--detach", action="store_true", help="run in the background; `keel down` stops it")
    up.add_argument("--demo", action="store_true", help="send one demo request once serving")
    sub.add_parser("down", help="stop a detached mesh")
    sub.add_parser("status", help="health of every process")
    a = sub.add_parser("ask", help="send one prompt through the gateway")
    a.add_argument("prompt")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--seed", type=int)
    a.add_argument("--domain", default="")
    a.add_argument("--json", action="store_true")
    c = sub.add_parser("certs", help="make the mesh's TLS certificates (CA, server, client)")
    c.add_argument("--out", type=Path, default=VAR_DIR / "certs")
    c.add_argument("--days", type=int, default=365)
    delegated = ("trace", "tokenize", "detokenize", "quarantine", "replay", "verify", "feedback", "etl")
    for name in delegated:
        sub.add_parser(name, add_help=False)
    args, rest = ap.parse_known_args(argv)
    if args.cmd in delegated:
        from keelctl import tools
        return tools.dispatch(args.cmd, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        commands = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "ask": cmd_ask, "certs": cmd_certs}
        return commands[args.cmd](args)
    except ConfigError as exc:  # e.g. KEEL_MESH_TLS_DIR without its certificates
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
