"""What the HTTP stage accepts from a client before the gateway sees anything (config block ``edge``).

Every limit of the internet-facing edge is here, with its default; docs/security.md states them.
A client over one of them is refused by this stage alone, in OpenAI's error shape, never 500.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EdgeLimits:
    # The request line and headers must arrive within this long of the connection opening (or of
    # the request's first byte on a kept-alive connection); else the connection is closed.
    header_timeout_s: float = 10.0
    # The whole body must arrive within this long of the headers; else the connection is closed.
    body_timeout_s: float = 30.0
    # The request line and all headers together (larger: 431 HEADER_TOO_LARGE, connection closed).
    max_header_bytes: int = 16384
    # How many header lines one request may have (more: 431 HEADER_TOO_LARGE).
    max_headers: int = 64
    # One header passed on to the gateway (key, trace context): gRPC metadata must stay far under
    # its own size limit, which would otherwise answer RESOURCE_EXHAUSTED (a retry hint).
    max_forwarded_header_bytes: int = 4096
    # JSON objects and arrays nested deeper than this are refused (400 INVALID_BODY) before parsing.
    max_json_depth: int = 128
    # x-keel-deadline-ms above this is refused (400 INVALID_HEADER): one hour.
    max_deadline_ms: int = 3_600_000
    # A body that may be larger than this (by Content-Length, or chunked) is read only after the
    # gateway has accepted the caller's key; a smaller one goes with the call as it is.
    preauth_body_bytes: int = 65536
    # OpenAI's `n`: at most this many choices per prompt (more: 400 N_OUT_OF_RANGE); each is one
    # generation through the gateway, run side by side.
    max_choices: int = 16
    # /v1/completions' list of prompts: at most this many in one request (more: 400 TOO_MANY_PROMPTS).
    max_prompts: int = 32

    def __post_init__(self) -> None:
        # Each field's own bounds are config/schemas/openai.schema.json's; this is the rule between two.
        if self.max_forwarded_header_bytes > self.max_header_bytes:
            raise ValueError("edge limits need max_forwarded_header_bytes <= max_header_bytes")
