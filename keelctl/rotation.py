"""`keel rotation status | history | approve ID | dry-run`: see and drive metric-driven rotation.

Talks to the feedback stage (keel.feedback.v1.Feedback, the rotation RPCs) with the running mesh's
token (from `keel up`'s state file, else KEEL_MESH_TOKEN). ``dry-run`` reads the alerts active in
Alertmanager now (its v2 API) and shows what the executor would do with each, changing nothing.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time

import grpc
import requests

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keelctl.layout import load_layout, read_state
from shared import meshauth, tls
from shared.config import ConfigError
from shared.durations import parse_duration

ALERTMANAGER = "http://127.0.0.1:9093"
TIMEOUT_S = 30.0


def _metadata() -> tuple[tuple[str, str], ...]:
    token = read_state().get("mesh_token") or meshauth.token()
    return ((meshauth.HEADER, token),) if token else ()


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _line(d: feedback_pb2.RotationDecision) -> str:
    extra = f" reverts #{d.reverts}" if d.reverts else ""
    return (f"#{d.id:<5} {_when(d.created_unix_ms)}  {d.rule} [{d.phase}] {d.action} -> {d.outcome} "
            f"({d.mode}, by {d.actor}{extra}): {d.detail}")


def _as_json(d: feedback_pb2.RotationDecision) -> str:
    from google.protobuf import json_format
    return json.dumps(json_format.MessageToDict(d, preserving_proto_field_name=True), sort_keys=True)


def active_alerts(url: str) -> list[feedback_pb2.RotationAlert]:
    """The alerts Alertmanager holds now, as the dry run takes them (firing)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--alertmanager must be an http(s) URL, got {url!r}")
    r = requests.get(f"{url.rstrip('/')}/api/v2/alerts", params={"active": "true"}, timeout=TIMEOUT_S)
    r.raise_for_status()
    listed = r.json()
    return [feedback_pb2.RotationAlert(labels=a.get("labels", {}), annotations=a.get("annotations", {}),
                                       fingerprint=a.get("fingerprint", ""), starts_at=a.get("startsAt", ""),
                                       status="firing") for a in listed]


def run(stub, args) -> int:
    md = _metadata()
    if args.cmd == "status":
        st = stub.RotationStatus(feedback_pb2.RotationStatusRequest(), metadata=md, timeout=TIMEOUT_S)
        print(f"mode: {st.mode}    webhook: {st.webhook_url or 'off'}")
        for r in st.replicas:
            print(f"  inference {r.target:<22} variant {r.active or '?'}" + (f"  ({r.error})" if r.error else ""))
        for c in st.cooldowns:
            left = f"{c.remaining_s:.0f} s left (from #{c.last_decision_id})" if c.remaining_s else "ready"
            print(f"  {c.action:<17} cooldown {c.cooldown_s:g} s: {left}")
        print(f"proposals waiting: {len(st.proposals)}")
        for d in st.proposals:
            print("  " + _line(d))
        return 0
    if args.cmd == "history":
        since = int((time.time() - parse_duration(args.since)) * 1000) if args.since else 0
        got = stub.RotationHistory(feedback_pb2.RotationHistoryRequest(limit=args.limit, since_unix_ms=since),
                                   metadata=md, timeout=TIMEOUT_S)
        for d in got.decisions:
            print(_as_json(d) if args.json else _line(d))
        return 0
    if args.cmd == "approve":
        got = stub.ApproveDecision(feedback_pb2.ApproveDecisionRequest(id=args.id, actor=args.actor),
                                   metadata=md, timeout=TIMEOUT_S)
        print(_line(got.decision))
        return 0 if got.decision.outcome == "applied" else 1
    alerts = active_alerts(args.alertmanager)
    got = stub.RotationDryRun(feedback_pb2.RotationDryRunRequest(alerts=alerts), metadata=md, timeout=TIMEOUT_S)
    if not got.verdicts:
        print(f"no Keel alert is active in {args.alertmanager}")
    for v in got.verdicts:
        print(f"{v.rule} ({v.action}, {v.fingerprint}): would {v.would}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel rotation", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("status", help="mode, every replica's variant, cooldowns, proposals waiting")
    h = sub.add_parser("history", help="decisions, newest first")
    h.add_argument("--limit", type=int, default=50)
    h.add_argument("--since", default="", help="e.g. 24h, 7d (default: all)")
    h.add_argument("--json", action="store_true", help="one JSON object a line")
    a = sub.add_parser("approve", help="apply a proposed decision now")
    a.add_argument("id", type=int)
    a.add_argument("--actor", default=os.environ.get("KEEL_ACTOR") or getpass.getuser(),
                   help="who approves (recorded; default: KEEL_ACTOR, else your user name)")
    d = sub.add_parser("dry-run", help="what the alerts active in Alertmanager now would do")
    d.add_argument("--alertmanager", default=os.environ.get("KEEL_ALERTMANAGER_URL", ALERTMANAGER))
    args = p.parse_args(argv)
    try:
        target = load_layout().targets("feedback")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not target:
        print("error: the mesh layout has no feedback stage", file=sys.stderr)
        return 2
    try:
        with tls.sync_channel(target[0]) as ch:
            return run(feedback_pb2_grpc.FeedbackStub(ch), args)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError, requests.RequestException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
