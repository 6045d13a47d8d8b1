"""Quarantine/review records: what is kept about a rejected input or a doubtful output.

A record gets its ``record_id`` when it is created and keeps it through the spill file and the
replay, which is what lets the replay de-duplicate. Payloads are made JSON-safe here, once, by
a deterministic conversion (bytes, sets, NaN, non-string keys, absurd nesting): a rejected
payload is by definition malformed, and quarantining it must not fail on its shape.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shared.clip import TRUNCATED, canonical_json, clip_payload, is_clipped

_MAX_DEPTH = 32
_MAX_STR = 65536


def json_safe(value: Any, depth: int = 0) -> Any:
    """A JSON-serialisable, deterministic copy of ``value``."""
    if depth > _MAX_DEPTH:
        return "<nested too deep>"
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return value if len(value) <= _MAX_STR else value[:_MAX_STR] + "…"
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": bytes(value[:_MAX_STR]).hex()}
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_safe(v, depth + 1) for v in value), key=repr)
    return repr(value)[:_MAX_STR]


def fingerprint(payload: Any) -> str:
    """sha256 of the canonical JSON of the (JSON-safe) payload: equal inputs, equal prints."""
    return hashlib.sha256(canonical_json(json_safe(payload)).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class QuarantineRecord:
    """One rejected/flagged input (kind ``input``) or one output sent for review
    (kind ``output``)."""

    kind: str
    reason: str
    rule: str
    trace_id: str
    source: str
    domain: str
    payload: dict
    message: str = ""
    flags: tuple[str, ...] = ()
    probes: dict = field(default_factory=dict)
    fingerprint: str = ""
    ts_ms: int = 0
    record_id: str = ""

    def __post_init__(self) -> None:
        # Fill derived fields on creation; a record read back keeps the stored ones.
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint(self.payload))
        if not self.ts_ms:
            object.__setattr__(self, "ts_ms", int(time.time() * 1000))
        if not self.record_id:
            object.__setattr__(self, "record_id", uuid.uuid4().hex)

    @classmethod
    def for_input(cls, payload: Any, verdict: Any, *, trace_id: str, source: str,
                  max_payload_bytes: int | None = None) -> QuarantineRecord:
        """Record of an input the :class:`InputChecker` rejected or flagged. A payload whose
        JSON exceeds ``max_payload_bytes`` (or that arrived clipped) is kept clipped
        (shared/clip.py), its fingerprint being the sha256 of the whole."""
        if max_payload_bytes is not None:
            payload = clip_payload(payload, max_payload_bytes)
        safe = json_safe(payload)
        return cls(kind="input", reason=verdict.reason or "", rule=verdict.rule or "",
                   trace_id=trace_id, source=source, domain=verdict.domain,
                   payload=safe if isinstance(safe, dict) else {"$value": safe},
                   message=verdict.message, flags=tuple(verdict.flags),
                   fingerprint=payload[TRUNCATED]["sha256"] if is_clipped(payload) else "")

    def to_json(self) -> str:
        return canonical_json(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> QuarantineRecord:
        d = json.loads(line)
        d["flags"] = tuple(d.get("flags", ()))
        return cls(**d)

    def to_fields(self) -> dict[str, str]:
        """Flat string fields for a Redis stream entry."""
        d = asdict(self)
        return {k: (canonical_json(v) if isinstance(v, (dict, list, tuple)) else str(v))
                for k, v in d.items()}

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> QuarantineRecord:
        f = dict(fields)
        return cls(kind=f["kind"], reason=f["reason"], rule=f["rule"], trace_id=f["trace_id"],
                   source=f["source"], domain=f["domain"], payload=json.loads(f["payload"]),
                   message=f.get("message", ""), flags=tuple(json.loads(f.get("flags", "[]"))),
                   probes=json.loads(f.get("probes", "{}")), fingerprint=f["fingerprint"],
                   ts_ms=int(f["ts_ms"]), record_id=f["record_id"])
