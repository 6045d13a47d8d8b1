"""`keel lora`: the LoRA adapter registry (services/inference/lora) from the command line.

    keel lora register PATH [--id ID] [--version V] [--training-data-manifest FILE] [--format F]
    keel lora list [--offline] [--target HOST:PORT] [--json]   versions, the base each fits, replica state
    keel lora verify [--format F]        re-check every version against the current base; retrain requests
    keel lora drift ID@VERSION [--format F]    KL(registered || now) on the check prompts
    keel lora card ID@VERSION            the version's model card

register, verify and drift load the base model from the inference stage's config (model_path) in the
weight format the stage last served (the registry's base.json; else engine.format, float32 for auto)
and run the check prompts through the engine's own runner. An adapter is bound to the weights, not to
that format (docs/lora.md, "The first adapter on a fresh clone"). Exit status: 0 ok; 1 a refusal, a version that
needs retraining or significant drift; 2 bad arguments or configuration.
"""
from __future__ import annotations

import argparse
import json
import sys

from services.inference import adapters
from shared.config import ConfigError
from shared.errors import KeelError


def cmd_register(cfg, args) -> int:
    from pathlib import Path

    from shared.progress import Progress

    src = Path(args.path)
    adapter_id = args.id or src.resolve().name
    version = args.version
    if version is None:  # next integer after the registered numeric versions of this id
        numeric = [int(f.name) for f in adapters.versions(cfg.lora.root)
                   if f.parent.name == adapter_id and f.name.isdigit()]
        version = str(max(numeric, default=0) + 1)
    base = adapters.running_base(cfg, args.format)
    with Progress(f"{adapter_id}@{version}: check runs", adapters.forward_steps(base), unit="step") as bar:
        m = adapters.register(src, adapter_id, version, base, cfg.lora,
                     Path(args.training_data_manifest) if args.training_data_manifest else None, bar.update)
    kl = m.kl_vs_base
    print(f"registered {m.name} in {cfg.lora.root / m.id / m.version}")
    print(f"  base fingerprint {m.base_fingerprint}; golden outputs made in {m.base['format']} "
          "(another serving format is checked by the drift gate)")
    print(f"  rank {m.rank}, alpha {m.alpha:g}, targets {', '.join(m.targets)}")
    print(f"  golden outputs: {len(m.golden_ids)} prompts x {len(m.golden_ids[0])} tokens; "
          f"{kl['direction']} mean {kl['mean']:.4f}, p95 {kl['p95']:.4f}")
    return 0


def _replica_states(cfg, args) -> dict[str, dict[str, str]] | None:
    """{target: {"id@version": "accepted slot N" | "refused REASON"}} from running replicas; None offline."""
    import grpc

    from keel.inference.v1 import inference_pb2, inference_pb2_grpc
    from keelctl import procs
    from keelctl.layout import load_layout, read_state
    from shared import meshauth, tls

    if args.offline:
        return None
    state = read_state()
    if args.target:
        targets = [args.target]
    elif procs.is_supervisor(state.get("pid")):
        targets = load_layout().targets("inference")
    else:
        return None
    token = state.get("mesh_token") or meshauth.token()
    metadata = [(meshauth.HEADER, token)] if token else []
    out = {}
    for target in targets:
        try:
            with tls.sync_channel(target) as ch:
                resp = inference_pb2_grpc.InferenceStub(ch).ListAdapters(
                    inference_pb2.ListAdaptersRequest(), metadata=metadata, timeout=5)
        except grpc.RpcError as exc:
            out[target] = {"": f"unreachable ({exc.code().name})"}
            continue
        out[target] = {f"{a.id}@{a.version}": (f"accepted slot {a.slot}" if a.state == "accepted"
                                               else f"refused {a.reason}") for a in resp.adapters}
        out[target]["(base)"] = resp.base_fingerprint
    return out


def cmd_list(cfg, args) -> int:
    rows, running = adapters.matrix(cfg.lora)
    replicas = _replica_states(cfg, args)
    if args.json:
        print(json.dumps({"running_base": running, "versions": adapters.as_json(rows), "replicas": replicas},
                         indent=1))
        return 0
    print(f"registry {cfg.lora.root}")
    print(f"running base {adapters.digest(running)[:16] if running else '(no stage has started with this registry)'}")
    for target, states in (replicas or {}).items():
        print(f"replica {target}: base {states.get('(base)', '?')[:16]}")
    print(f"{'ADAPTER':<28} {'REGISTERED BASE':<18} {'FITS RUNNING BASE':<30} STATE")
    for r in rows:
        fits = "?" if r.fits_running is None else "yes" if r.fits_running else "no: " + ",".join(r.differing)
        if replicas is None:
            state = "offline"
        else:
            state = "; ".join(f"{t}: {s.get(r.name, 'not loaded')}" for t, s in replicas.items())
        print(f"{r.name:<28} {r.base_fingerprint[:16] or 'unreadable':<18} {fits:<30} {state}")
    return 0


def cmd_verify(cfg, args) -> int:
    verdicts = adapters.verify(cfg.lora, adapters.running_base(cfg, args.format))
    retrain = [v for v in verdicts if v.retrain_request is not None]
    for v in verdicts:
        s = v.state
        line = f"{s.name:<28} {s.state}" + (f" {s.reason}: {s.detail}" if s.reason else "")
        print(line + (f"\n{'':<28} needs retraining: {v.retrain_request}" if v.retrain_request else ""))
    print(f"{len(verdicts)} version(s) checked, {len(retrain)} need retraining")
    return 1 if retrain else 0


def cmd_drift(cfg, args) -> int:
    d = adapters.measure_drift(cfg.lora, adapters.running_base(cfg, args.format), args.adapter)
    print(f"{d['adapter']}: {d['direction']} over {d['positions']} check positions: mean {d['mean']:.6f}, "
          f"p95 {d['p95']:.6f} nats/token (threshold {d['threshold']}); greedy agreement {d['greedy_agreement']:.3f}")
    print("significant drift" if d["significant"] else "no significant drift")
    return 1 if d["significant"] else 0


def cmd_card(cfg, args) -> int:
    print(adapters.card(cfg, args.adapter), end="")
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="keel lora", description="LoRA adapters: register, list, verify, drift, card")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("register", help="register a PEFT adapter folder")
    r.add_argument("path")
    r.add_argument("--id")
    r.add_argument("--version")
    r.add_argument("--training-data-manifest")
    l_ = sub.add_parser("list", help="the version matrix and each replica's state")
    l_.add_argument("--offline", action="store_true", help="do not ask running replicas")
    l_.add_argument("--target", help="an inference replica host:port (default: the running mesh's)")
    l_.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="re-check every version against the current base")
    d = sub.add_parser("drift", help="KL(registered || now) of one version")
    d.add_argument("adapter", metavar="ID@VERSION")
    c = sub.add_parser("card", help="print a version's model card")
    c.add_argument("adapter", metavar="ID@VERSION")
    for p in (r, v, d):
        p.add_argument("--format", help="weight format of the base (default: the one the stage last served)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    commands = {"register": cmd_register, "list": cmd_list, "verify": cmd_verify, "drift": cmd_drift,
                "card": cmd_card}
    try:
        return commands[args.cmd](adapters.load_config(), args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeelError as exc:
        meta = "".join(f" {k}={v}" for k, v in exc.metadata.items())
        print(f"refused: {exc.reason}: {exc.message}{meta}", file=sys.stderr)
        return 2 if exc.code == "INVALID_ARGUMENT" else 1
