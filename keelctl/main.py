"""The `keel` command: run the mesh and talk to it.

    keel up [--detach] [--demo] [--model PATH]   start Redis + every stage, show what each is doing until
                                  SERVING; --model: serve this GGUF or Hugging Face folder (docs/models.md)
                                  (keelctl/startview.py), print where each listens
    keel down                     stop the mesh (drains in-flight calls), and any process it left
    keel status                   health of every process of the running mesh (and what a starting one does)
    keel ask "PROMPT" [--max-tokens N] [--temperature T] [--seed S] [--adapter ID[@VERSION]] [--json]
             [--stop S]... [--json-schema FILE | --regex R | --choice A...] [--logprobs N]
             [--repetition-penalty P] [--frequency-penalty P] [--presence-penalty P]   (docs/generation.md)
    keel trace TRACE_ID           the whole chain of one request, across every stage's trace files
                                  (--format chrome: a Chrome Trace Event file)
    keel tokenize | detokenize    JSON lines on stdin -> stdout, in-process
    keel quarantine list|show|replay|purge ...
    keel replay TRACE_ID...       re-run recorded requests; "identical" or the first differing token
    keel verify determinism [--sample N] [--since 24h]   replay a sample of recent requests
    keel feedback submit|list     report a bad answer (through the gateway); list reports
    keel etl run --since 24h --out DIR   severe factual errors -> a reproducible JSONL chat dataset
    keel variant [set NAME]       the model variant each inference replica serves; switch it
    keel rotation status|history|approve ID|dry-run   metric-driven rotation (docs/rotation.md)
    keel certs [--out var/certs]  TLS certificates for the mesh (then KEEL_MESH_TLS_DIR=var/certs keel up)
    keel lora register|list|verify|drift|card ...   LoRA adapters (keelctl/lora.py)
    keel doctor                   check this host before a first start; says what to fix (keelctl/doctor.py)
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

from keelctl import health, procs, startview
from keelctl.layout import LOG_DIR, ROOT, RUN_DIR, VAR_DIR, load_layout, read_state
from shared import modelcard, modelfile
from shared.config import EXIT_CONFIG, ConfigError
from shared.stages import STAGE_ORDER

DEMO_PROMPT = "What is the capital of France?"
# Leftover processes get SIGTERM (a stage drains its in-flight calls), then SIGKILL after this long.
STOP_GRACE_S = 60.0


def _targets(layout) -> dict[str, tuple[str, str]]:
    return {f"{stage}@{t}": (t, health.service_of(stage)) for stage in STAGE_ORDER for t in layout.targets(stage)}


def _print_table(layout, statuses: dict[str, str]) -> None:
    for name, st in statuses.items():
        print(f"  {name:<28} {st}")
    print(f"  redis@127.0.0.1:{layout.redis.port}")


def _gateway(layout) -> str:
    return layout.targets("gateway")[0]


def _entries(layout) -> str:
    """Where clients connect: the gateway (gRPC), and the OpenAI-compatible HTTP API when it runs."""
    http = layout.targets("openai")
    return f"gateway at {_gateway(layout)}" + (f"; OpenAI-compatible HTTP API at {_http_url(http[0])}" if http else "")


def _http_url(target: str) -> str:
    from shared import tls
    return f"{'https' if tls.mesh_dir() else 'http'}://{target}/v1"


def _preflight(layout) -> str | None:
    """Make room for a new mesh, or say why there is none: a live supervisor of this run directory
    refuses; processes left by a dead one are stopped; a port held by anything else refuses,
    naming the pid that holds it."""
    from keelctl.supervisor import layout_ports

    pid = read_state().get("pid")
    if pid != os.getpid() and procs.is_supervisor(pid):
        return f"keel is already running (supervisor pid {pid}); `keel down` stops it"
    left = procs.run_dir_processes(RUN_DIR)
    if left:
        print(f"stopping {len(left)} process(es) a previous keel left in {RUN_DIR}: "
              + ", ".join(f"pid {p.pid}" for p in left), flush=True)
        procs.stop(left, STOP_GRACE_S)
    held = procs.held_ports(layout_ports(layout))
    if held:
        return "ports in use:\n" + "\n".join(
            f"  port {h.port} ({h.what}) is held by " + (f"pid {h.pid}: {h.command}" if h.pid else "an unknown process")
            for h in held)
    return None


def cmd_up(args) -> int:
    import logging

    from keelctl.supervisor import Supervisor
    from shared import metrics
    from shared.logging import JsonFormatter, setup_logging

    layout = load_layout()
    if args.model:  # every stage started from here reads it (shared/modelfile.py)
        os.environ[modelfile.ENV] = str(Path(args.model).expanduser().resolve())
    try:
        model = modelcard.read(modelfile.source())
    except ConfigError as exc:
        print(f"keel up refused: {exc}", flush=True)
        return EXIT_CONFIG
    print(f"model {model.source.model_id} ({model.architecture}, {model.context_tokens} tokens of context, "
          f"{model.source.path})", flush=True)
    problem = _preflight(layout)
    if problem:
        print(f"keel up refused: {problem}", flush=True)
        return 1
    if args.detach:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with open(LOG_DIR / "supervisor.out", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "keelctl", "up"], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        view = startview.StartView(_targets(layout))
        try:
            statuses = health.wait_serving(_targets(layout), layout.ready_timeout_s, lambda: proc.poll() is None,
                                           watch=view.update)
        except TimeoutError as exc:
            proc.terminate()  # no half-started mesh left behind
            state = read_state()  # the supervisor's own words on a stage's configuration error
            failed = state.get("failed") if state.get("pid") == proc.pid else None
            print(f"keel up failed: {failed or exc}; see {LOG_DIR}")
            return EXIT_CONFIG if failed else 1
        view.finish()
        print(f"keel is up (supervisor pid {proc.pid}); {_entries(layout)}")
        _print_table(layout, statuses)
        return 0

    setup_logging("supervisor")
    view = startview.StartView(_targets(layout))
    # The terminal gets problems only, one readable line each; the JSON records go to the log file.
    logging.getLogger().handlers[:] = [startview.LogHandler(view)]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(LOG_DIR / "supervisor.log")
    fh.setFormatter(JsonFormatter("supervisor"))
    logging.getLogger().addHandler(fh)
    sup = Supervisor(layout)
    if layout.metrics_port:
        metrics.start_metrics_server(layout.metrics_port, addr="127.0.0.1")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    failed = threading.Event()

    def announce() -> None:
        try:
            statuses = health.wait_serving(_targets(layout), layout.ready_timeout_s,
                                           lambda: not stop.is_set() and not sup.failed, watch=view.update)
        except TimeoutError as exc:
            if sup.failed:
                return  # the main thread says why
            print(f"keel up failed: {exc}; see {LOG_DIR}", flush=True)
            failed.set()
            stop.set()
            return
        view.finish()
        print(f"keel is up; {_entries(layout)}", flush=True)
        _print_table(layout, statuses)
        if args.demo:
            from keelctl import ask
            print(f"\ndemo> {DEMO_PROMPT}", flush=True)
            ask.main(_gateway(layout), prompt=DEMO_PROMPT, max_tokens=48, temperature=0.0, seed=None, as_json=False)
            print("\nserving until Ctrl-C ...", flush=True)

    # Children are forked from this (main) thread only: their parent-death signal is tied to it.
    sup.start()
    threading.Thread(target=announce, daemon=True).start()
    sup.run(stop)  # returns at a stop signal or when a stage's configuration is invalid
    sup.stop()
    if sup.failed:
        print(f"keel up failed: {sup.failed}; see {LOG_DIR}", flush=True)
        return EXIT_CONFIG
    return 1 if failed.is_set() else 0


def cmd_down(args) -> int:
    pid = read_state().get("pid")
    running = procs.is_supervisor(pid)
    if running:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 240  # each stage drains its in-flight calls first
        while procs.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if procs.alive(pid):
            print(f"supervisor {pid} did not stop within 240 s")
            return 1
    left = procs.run_dir_processes(RUN_DIR)
    if left:
        print(f"stopping {len(left)} process(es) of {RUN_DIR} that have no supervisor: "
              + ", ".join(f"pid {p.pid}" for p in left))
        procs.stop(left, STOP_GRACE_S)
    print("keel is down" if running or left else "keel is not running")
    return 0


def cmd_status(args) -> int:
    from keelctl.supervisor import layout_ports

    layout = load_layout()
    state = read_state()
    if not procs.is_supervisor(state.get("pid")):
        # Whatever answers on the layout's ports now is not this run directory's mesh: never "healthy".
        print(f"keel is not running (no supervisor for {RUN_DIR})")
        for p in procs.run_dir_processes(RUN_DIR):
            print(f"  left without a supervisor: pid {p.pid}  {procs.describe(p.pid)}")
        for h in procs.held_ports(layout_ports(layout)):
            print(f"  port {h.port} ({h.what}) is held by pid {h.pid}, not managed by a supervisor")
        return 1
    targets = _targets(layout)
    statuses = {name: health.status(t, s) for name, (t, s) in targets.items()}
    procs_state = state.get("processes", {})
    if state.get("model"):
        print(f"  model {_model_line(state['model'])}")
        for target in layout.targets("inference"):
            print(f"  inference@{target} serves it in {_served_format(target)}")
    for name, st in statuses.items():  # with what each process says it is doing, unless just serving
        print(f"  {name:<28} {startview.row(st, startview.stage_status(targets[name][0]))}")
    for name, p in procs_state.items():
        print(f"  {name:<28} pid {p.get('pid')}  restarts {p.get('restarts')}")
    return 0 if all(v == "SERVING" for v in statuses.values()) else 1


def _served_format(target: str) -> str:
    """The weight format the replica at `target` serves new requests in (its active variant's)."""
    import grpc

    from keel.inference.v1 import inference_pb2
    from keelctl.variant import call

    try:
        r = call(target, "GetVariant", inference_pb2.GetVariantRequest())
    except grpc.RpcError as exc:
        return f"an unknown format ({exc.code().name})"
    return f"{r.variants.get(r.active, '?')} (variant {r.active})"


def _model_line(pinned: dict) -> str:
    """The served model as `keel status` shows it: name, family, context, template, weight types."""
    try:
        card = modelcard.read(modelfile.source(pinned.get(modelfile.ENV), environ=pinned))
    except ConfigError as exc:
        return f"{pinned.get(modelfile.NAME_ENV)}: unreadable now ({exc})"
    facts = card.as_dict()
    return (f"{facts['model_id']}  {facts['architecture']}, context {facts['context_tokens']}, "
            f"chat template: {facts['chat_template']}, weights {', '.join(facts['weight_types'])}  {card.source.path}")


def cmd_ask(args) -> int:
    from keelctl import ask
    return ask.main(_gateway(load_layout()), prompt=args.prompt, max_tokens=args.max_tokens,
                    temperature=args.temperature, seed=args.seed, as_json=args.json, domain=args.domain,
                    adapter=args.adapter, controls=ask.controls_from_args(args), timeout_s=args.timeout)


def cmd_certs(args) -> int:
    from keelctl import certs
    print(f"certificates in {certs.make(args.out, args.days)}; start the mesh with KEEL_MESH_TLS_DIR={args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`keel status | head`): stop quietly; the interpreter's own flush of
        # stdout at exit would raise again, so stdout goes to /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="keel", description="Run and use the Keel mesh.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the mesh")
    up.add_argument("--detach", action="store_true", help="run in the background; `keel down` stops it")
    up.add_argument("--demo", action="store_true", help="send one demo request once serving")
    up.add_argument("--model", help="a GGUF file or Hugging Face folder to serve (default: config/keel.yaml's model)")
    sub.add_parser("down", help="stop a detached mesh")
    sub.add_parser("status", help="health of every process")
    a = sub.add_parser("ask", help="send one prompt through the gateway")
    a.add_argument("prompt")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--seed", type=int)
    a.add_argument("--domain", default="")
    a.add_argument("--adapter", default="", help='LoRA adapter: "id" or "id@version" (default: the base model)')
    a.add_argument("--json", action="store_true")
    a.add_argument("--stop", action="append", help="stop string (repeatable)")
    fmt = a.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", help="constrain the answer to this JSON Schema")
    fmt.add_argument("--regex", help="constrain the answer to this regular expression")
    fmt.add_argument("--choice", action="append", help="the answer is one of these (repeatable)")
    a.add_argument("--logprobs", type=int, metavar="N", help="print each token's logprob and N alternatives (0-5)")
    a.add_argument("--repetition-penalty", type=float, default=1.0)
    a.add_argument("--frequency-penalty", type=float, default=0.0)
    a.add_argument("--presence-penalty", type=float, default=0.0)
    a.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="the call's deadline (default 60; a large model on a slow host may need more)")
    c = sub.add_parser("certs", help="make the mesh's TLS certificates (CA, server, client)")
    c.add_argument("--out", type=Path, default=VAR_DIR / "certs")
    c.add_argument("--days", type=int, default=365)
    delegated = ("trace", "tokenize", "detokenize", "quarantine", "replay", "verify", "feedback", "etl", "variant",
                 "rotation", "lora", "doctor")
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
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
