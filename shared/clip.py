"""Oversized request payloads, kept for the quarantine as a bounded stand-in.

A rejected request can be far larger than what a gRPC message or a Redis stream entry should
carry (a 700 KB prompt of control characters is 4.2 MB of escaped JSON). :func:`clip_payload`
keeps such a payload as the first ``limit_bytes`` of its canonical JSON plus the sha256 and the
size of the whole, so the quarantine still says exactly what was sent and recognises a repeat.
The gateway clips before handing a rejected input to the validator; the validator clips before
storing.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

TRUNCATED = "$truncated"   # {"sha256": hex of the whole canonical JSON, "bytes": its size}
HEAD = "$head"             # the canonical JSON's first bytes (cut on a character boundary)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def clip_payload(payload: Any, limit_bytes: int) -> Any:
    """``payload`` itself when its canonical JSON fits ``limit_bytes``, else
    ``{"$truncated": {"sha256": ..., "bytes": ...}, "$head": ...}``."""
    if is_clipped(payload):
        return payload
    text = canonical_json(payload).encode("utf-8", "surrogatepass")
    if len(text) <= limit_bytes:
        return payload
    return {TRUNCATED: {"sha256": hashlib.sha256(text).hexdigest(), "bytes": len(text)},
            HEAD: text[:limit_bytes].decode("utf-8", "ignore")}


def is_clipped(payload: Any) -> bool:
    return (isinstance(payload, dict) and isinstance(payload.get(TRUNCATED), dict)
            and isinstance(payload[TRUNCATED].get("sha256"), str))
