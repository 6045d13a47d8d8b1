"""`keel replay TRACE_ID...` and `keel verify determinism`: re-run recorded requests against the running mesh.

A replay sends the recorded conversation with the recorded sampling parameters and seed through
the gateway, alone (one request at a time), then reads the replay's own record from the feedback
database and compares the two (services/feedback/replay.py).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import grpc
from google.protobuf import json_format
from prometheus_client import CollectorRegistry, push_to_gateway, write_to_textfile

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl import ask
from keelctl.layout import load_layout
from services.feedback import config as fb_config
from services.feedback.records import ReplayRecord
from services.feedback.replay import Outcome, can_run, compare
from services.feedback.store import Store, now_ms, open_store
from shared import errors, metrics
from shared.controls import format_pb, sampling_pb
from shared.durations import parse_duration
from shared.progress import Progress

RECORD_WAIT_S = 30.0


def request_of(record: ReplayRecord) -> gateway_pb2.GenerateRequest:
    # The adapter as it served ("id@version"), so a newer version registered since is not picked up.
    req = gateway_pb2.GenerateRequest(sampling=sampling_pb(record.sampling), domain=record.domain,
                                      source=record.source, adapter=record.adapter)
    fmt = format_pb(record.sampling.controls.response_format)
    if fmt is not None:
        req.response_format.CopyFrom(fmt)
    # The input as it was sent: a conversation, a raw text, or (neither) token ids, which are the prompt's.
    if record.messages:
        req.chat.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in record.messages)
    elif record.text is not None:
        req.text = record.text
    else:
        req.token_ids.extend(record.prompt_ids or ())
    if record.tool_use is not None:
        _ask_tools(req, record.tool_use)
    return req


def _ask_tools(req: gateway_pb2.GenerateRequest, use) -> None:
    """The record's tools, tool_choice and turn calls back on the request (the gateway renders them again)."""
    for i, turn in use.get("turns", {}).items():
        message = req.chat.messages[int(i)]
        message.tool_call_id = turn.get("tool_call_id", "")
        message.tool_calls.extend(json_format.ParseDict(c, common_pb2.ToolCall()) for c in turn.get("tool_calls", ()))
    req.tools.extend(json_format.ParseDict(t, common_pb2.Tool()) for t in use.get("tools", ()))
    if "tool_choice" in use:
        req.tool_choice.CopyFrom(json_format.ParseDict(use["tool_choice"], common_pb2.ToolChoice()))
    if "parallel_tool_calls" in use:
        req.parallel_tool_calls = use["parallel_tool_calls"]


def replay_one(store: Store, record: ReplayRecord, target: str) -> Outcome:
    blocked = can_run(record)
    if blocked is not None:
        return blocked
    resp = ask.ask(target, request_of(record))
    deadline = time.monotonic() + RECORD_WAIT_S
    while (again := store.get_record(resp.trace_id)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replay's record {resp.trace_id} did not reach the feedback database "
                               f"within {RECORD_WAIT_S:.0f}s")
        time.sleep(0.1)
    return compare(record, again)


def _store() -> Store:
    cfg = fb_config.load()
    return open_store(cfg.database_url, connect_timeout_s=cfg.database.connect_timeout_s)


def replay_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel replay", description="re-run recorded requests and compare")
    p.add_argument("trace_id", nargs="+", help="one or more trace ids; several replay one after another")
    args = p.parse_args(argv)
    store = _store()
    target = load_layout().targets("gateway")[0]
    if len(args.trace_id) == 1:
        return _replay_id(store, args.trace_id[0], target, print)
    results = []
    with Progress("replaying", len(args.trace_id), unit="request") as bar:
        for trace_id in args.trace_id:
            results.append(_replay_id(store, trace_id, target, lambda text, t=trace_id: bar.write(f"{t}  {text}")))
            bar.update()
    return max(results)


def _replay_id(store: Store, trace_id: str, target: str, say) -> int:
    """Replay one recorded request; `say` prints the outcome. 0 when identical, else 1."""
    record = store.get_record(trace_id)
    if record is None:
        print(f"error: no replay record for trace {trace_id}", file=sys.stderr)
        return 1
    try:
        outcome = replay_one(store, record, target)
    except grpc.RpcError as err:
        print(f"error: the replay of {trace_id} failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    say(outcome.describe() + (f"  (replay trace {outcome.replay_trace_id})" if outcome.replay_trace_id else ""))
    return 0 if outcome.result == "identical" else 1


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="keel verify determinism",
                                description="replay a sample of recent requests; non-zero exit on any mismatch")
    p.add_argument("what", choices=["determinism"])
    p.add_argument("--sample", type=int, default=20)
    p.add_argument("--since", default="24h", help="e.g. 24h, 7d")
    p.add_argument("--gateway", help="host:port (default: the local mesh layout's gateway)")
    p.add_argument("--push-gateway", help="push keel_determinism_checks_total to this Prometheus Pushgateway URL")
    p.add_argument("--metrics-file", help="write keel_determinism_checks_total here (Prometheus text format, "
                                          "for node-exporter's textfile collector)")
    args = p.parse_args(argv)
    store = _store()
    since = now_ms() - int(parse_duration(args.since) * 1000)
    records = [r for r in store.list_records(since) if can_run(r) is None]
    sample = random.Random().sample(records, min(args.sample, len(records)))
    target = args.gateway or load_layout().targets("gateway")[0]
    counts = {"identical": 0, "mismatch": 0, "not_comparable": 0, "failed": 0}
    with Progress("verify determinism", len(sample), unit="request") as bar:
        for record in sample:
            try:
                outcome = replay_one(store, record, target)
                counts[outcome.result] += 1
                bar.write(f"{record.trace_id}  {outcome.describe()}")
            except grpc.RpcError as err:  # one failed replay is counted, the check goes on
                counts["failed"] += 1
                bar.write(f"{record.trace_id}  failed: {err.code().name}: {err.details()}")
            except (TimeoutError, errors.KeelError) as exc:
                counts["failed"] += 1
                bar.write(f"{record.trace_id}  failed: {exc}")
            bar.update()
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    registry = CollectorRegistry()
    counter = metrics.metrics_for("keelctl", registry).counter("keel_determinism_checks_total")
    for result, n in counts.items():
        counter.labels(result=result).inc(n)
    if args.metrics_file:
        write_to_textfile(args.metrics_file, registry)
    if args.push_gateway:
        # Each run replaces the last one's values: the gauge-like reading is "the last check".
        push_to_gateway(args.push_gateway, job="keel-verify-determinism", registry=registry)
    return 1 if counts["mismatch"] else 0
