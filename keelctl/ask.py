"""`keel ask`: one request through the gateway, as a client would send it."""
from __future__ import annotations

import json
import os

import grpc
from google.protobuf import json_format

from keel.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from shared import client, tls
from shared.controls import Controls, ResponseFormat, Sampling, format_pb, sampling_pb

DEV_API_KEY = "keel-dev-key"  # matches the dev key hashed in config/gateway.yaml; never use in production


def build_request(prompt: str, *, max_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
                  domain: str = "", source: str = "", adapter: str = "",
                  controls: Controls = Controls()) -> gateway_pb2.GenerateRequest:
    sampling = sampling_pb(Sampling(max_tokens, temperature, seed=seed, controls=controls))
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling, domain=domain, source=source,
                                       adapter=adapter, response_format=format_pb(controls.response_format))


def controls_from_args(args) -> Controls:
    """The generation controls of `keel ask`'s flags (--stop, --json-schema FILE, --regex, --choice,
    --logprobs N, the penalties); the gateway checks their ranges."""
    fmt = None
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            fmt = ResponseFormat("json_schema", f.read())
    elif args.regex is not None:
        fmt = ResponseFormat("regex", args.regex)
    elif args.choice:
        fmt = ResponseFormat("choice", choices=tuple(args.choice))
    return Controls(stop=tuple(args.stop or ()), repetition_penalty=args.repetition_penalty,
                    frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                    logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, response_format=fmt)


def ask(target: str, request: gateway_pb2.GenerateRequest, *, api_key: str | None = None,
        timeout_s: float = 60.0) -> gateway_pb2.GenerateResponse:
    key = api_key or os.environ.get("KEEL_API_KEY", DEV_API_KEY)
    with tls.sync_channel(target) as ch:
        return gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=timeout_s,
                                                        metadata=(("x-api-key", key),))


def error_line(err: grpc.RpcError) -> str:
    """"error: CODE: REASON: message", the reason left out where it only repeats the code (a deadline
    that ran out in this client has no reason of its own)."""
    code, reason = err.code().name, client.translate(err).reason
    return f"error: {code}: {err.details()}" if reason == code else f"error: {code}: {reason}: {err.details()}"


def render(resp: gateway_pb2.GenerateResponse, as_json: bool) -> str:
    if as_json:
        return json.dumps(json_format.MessageToDict(resp, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True), ensure_ascii=False)
    served = f", adapter {resp.adapter}" if resp.adapter else ""
    lines = [f"{lp.token!r:>16} {lp.logprob:9.4f}  " + "  ".join(f"{a.token!r} "
                                                                 f"{a.logprob:.4f}" for a in lp.top_logprobs)
             for lp in resp.logprobs]
    return (f"{resp.text}\n\n" + "".join(line + "\n" for line in lines) +
            f"trace_id: {resp.trace_id}  ({resp.usage.completion_tokens} tokens, {resp.finish_reason}{served})")


def main(target: str, *, prompt: str, max_tokens: int, temperature: float, seed: int | None, as_json: bool,
         domain: str = "", adapter: str = "", controls: Controls = Controls(), timeout_s: float = 60.0) -> int:
    try:
        resp = ask(target, build_request(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                         domain=domain, adapter=adapter, controls=controls), timeout_s=timeout_s)
    except grpc.RpcError as err:
        print(error_line(err))
        return 1
    print(render(resp, as_json))
    return 0
