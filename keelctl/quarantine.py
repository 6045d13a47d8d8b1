"""`keel quarantine ...`: the validator's operator CLI, with `replay` wired to the gateway."""
from __future__ import annotations

from dataclasses import replace

from google.protobuf import json_format

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl import ask
from keelctl.layout import load_layout, read_state
from shared.controls import Sampling, sampling_pb


def payload_to_request(payload: dict) -> gateway_pb2.GenerateRequest:
    """The quarantined payload (the gateway request as the contract saw it) as a request again."""
    sampling = sampling_pb(Sampling(int(payload.get("max_tokens", 64)), float(payload.get("temperature", 0.0)),
                                    float(payload.get("top_p", 1.0)), int(payload.get("top_k", 0)),
                                    int(payload["seed"]) if "seed" in payload else None))
    req = gateway_pb2.GenerateRequest(sampling=sampling, domain=str(payload.get("domain", "")),
                                      source=str(payload.get("source", "")))
    if "messages" in payload:
        req.chat.messages.extend(common_pb2.ChatMessage(role=str(m.get("role", "")), content=str(m.get("content", "")))
                                 for m in payload["messages"])
    else:
        req.prompt = str(payload.get("prompt", ""))
    return req


def replay_through_gateway(payload: dict) -> dict:
    resp = ask.ask(load_layout().targets("gateway")[0], payload_to_request(payload))
    return json_format.MessageToDict(resp, preserving_proto_field_name=True)


def main(argv: list[str]) -> int:
    from services.validator import config as validator_config
    from services.validator import quarantine_cli
    cfg = validator_config.load().quarantine
    running = read_state().get("redis_url")  # the running mesh's Redis, with its per-`keel up` password
    if running:
        cfg = replace(cfg, redis_url=running)
    return quarantine_cli.main(argv, replay_fn=replay_through_gateway, cfg=cfg)
