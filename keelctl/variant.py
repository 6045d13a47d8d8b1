"""`keel variant`: which model variant each inference replica of the running mesh serves, and the switch.

    keel variant                           active variant and the preloaded ones (name=format), per replica
    keel variant set NAME [--actor WHO]    make NAME serve new requests on every inference replica

The switch is the inference stage's SetVariant (idempotent; requests in flight finish on their
variant); a restarted replica serves primary again (docs/inference-formats.md, "Variants and the switch").
"""
from __future__ import annotations

import argparse
import getpass
import sys

import grpc

from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keelctl.layout import load_layout, read_state
from shared import client, meshauth, tls

TIMEOUT_S = 30.0


def _metadata() -> list[tuple[str, str]]:
    token = read_state().get("mesh_token") or meshauth.token()
    return [(meshauth.HEADER, token)] if token else []


def call(target: str, method: str, request):
    with tls.sync_channel(target) as ch:
        return getattr(inference_pb2_grpc.InferenceStub(ch), method)(request, metadata=_metadata(), timeout=TIMEOUT_S)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="keel variant", description="Show or switch the inference model variant.")
    sub = ap.add_subparsers(dest="action")
    s = sub.add_parser("set", help="make a variant serve new requests on every inference replica")
    s.add_argument("name")
    s.add_argument("--actor", default=f"keel-cli:{getpass.getuser()}", help="who asks (in the stage's log line)")
    args = ap.parse_args(argv)
    failed = False
    for target in load_layout().targets("inference"):
        try:
            if args.action == "set":
                r = call(target, "SetVariant", inference_pb2.SetVariantRequest(variant=args.name, actor=args.actor))
                print(f"inference@{target}  {r.active} (was {r.previous})")
            else:
                r = call(target, "GetVariant", inference_pb2.GetVariantRequest())
                others = " ".join(f"{k}={v}" + (" (locked: not gated yet)" if k in r.locked else "")
                                  for k, v in sorted(r.variants.items()))
                print(f"inference@{target}  active {r.active}  variants {others}")
        except grpc.RpcError as exc:
            err = client.translate(exc)
            print(f"inference@{target}  error: {err.code} {err}", file=sys.stderr)
            failed = True
    return 1 if failed else 0
