"""`keel feedback submit|list`: report what was wrong with an answer; read what was reported.

``submit`` goes through the gateway's SubmitFeedback as any client would (API key from
KEEL_API_KEY, else the development key); ``list`` reads the feedback database directly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from keelctl.ask import DEV_API_KEY
from keelctl.layout import load_layout
from services.feedback import config as fb_config
from services.feedback.config import ERROR_TYPES, SEVERITIES
from services.feedback.store import now_ms, open_store
from shared import tls
from shared.durations import parse_duration


def submit(target: str, item: gateway_pb2.SubmitFeedbackRequest, *,
           timeout_s: float = 10.0) -> gateway_pb2.SubmitFeedbackResponse:
    key = os.environ.get("KEEL_API_KEY", DEV_API_KEY)
    with tls.sync_channel(target) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).SubmitFeedback(item, timeout=timeout_s,
                                                              metadata=(("x-api-key", key),))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel feedback")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="report a bad answer by its trace id")
    s.add_argument("trace_id")
    s.add_argument("--id", required=True, dest="feedback_id", help="your id for this item; resending it updates")
    s.add_argument("--error-type", required=True, help=", ".join(ERROR_TYPES))
    s.add_argument("--severity", required=True, help=", ".join(SEVERITIES))
    s.add_argument("--keyword", action="append", default=[], help="a word a correct answer contains (repeatable)")
    s.add_argument("--comment", default="")
    ls = sub.add_parser("list", help="feedback items as JSON lines, oldest first")
    ls.add_argument("--since", default="7d")
    ls.add_argument("--severity", action="append")
    ls.add_argument("--error-type", action="append")
    args = p.parse_args(argv)
    if args.cmd == "submit":
        item = gateway_pb2.SubmitFeedbackRequest(trace_id=args.trace_id, feedback_id=args.feedback_id,
                                         error_type=args.error_type, severity=args.severity,
                                         expected_keywords=args.keyword, comment=args.comment)
        try:
            resp = submit(load_layout().targets("gateway")[0], item)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
        print(f"{'created' if resp.created else 'updated'} {resp.feedback_id}")
        return 0
    cfg = fb_config.load()
    store = open_store(cfg.database_url, connect_timeout_s=cfg.database.connect_timeout_s)
    since = now_ms() - int(parse_duration(args.since) * 1000)
    for row in store.list_feedback(since, severities=args.severity, error_types=args.error_type):
        print(json.dumps(row, ensure_ascii=False, sort_keys=True))
    return 0
