"""Alertmanager's webhook payload (version 4) -> the alerts the rotation executor acts on.

Alertmanager POSTs ``{"version": "4", "status": ..., "alerts": [...], ...}``; each alert has
``status`` (firing | resolved), ``labels``, ``annotations``, ``startsAt``, ``endsAt`` and
``fingerprint``. Anything else is refused with INVALID_ALERT_PAYLOAD naming the field. An alert
without a ``keel_action`` label is not for Keel and is left out (the route only sends Keel's).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum

from shared import errors

ACTION_LABEL = "keel_action"
class Phase(StrEnum):
    """An alert's status as Alertmanager sends it; a decision is kept per phase."""

    FIRING = "firing"
    RESOLVED = "resolved"


PHASES = tuple(Phase)
MAX_ALERTS = 1000
_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


@dataclass(frozen=True)
class Alert:
    rule: str                    # labels.alertname
    action: str                  # labels.keel_action
    phase: str                   # firing | resolved
    fingerprint: str
    starts_at: str               # RFC 3339 in UTC to the millisecond (part of the idempotency key)
    labels: dict[str, str]
    annotations: dict[str, str]  # the rule's metric snapshot (one annotation per condition)


def _bad(field: str, why: str) -> errors.InvalidInput:
    return errors.InvalidInput(f"not an Alertmanager v4 payload: {field} {why}", reason="INVALID_ALERT_PAYLOAD",
                               metadata={"field": field})


def _str_map(value, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _bad(field, "must be an object of strings")
    return dict(value)


def _str(alert: dict, key: str, field: str, *, max_len: int = 200) -> str:
    value = alert.get(key)
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise _bad(f"{field}.{key}", f"must be a non-empty string of at most {max_len} characters")
    return value


def canonical_time(value: str, field: str) -> str:
    """RFC 3339 in UTC with milliseconds: the webhook sends nanoseconds, the v2 API milliseconds, and
    Prometheus keeps milliseconds, so the same alert has the same key whichever way it came."""
    m = _RFC3339.match(value)
    if not m:
        raise _bad(field, "must be an RFC 3339 time")
    whole, frac, zone = m.groups()
    try:
        t = datetime.fromisoformat(f"{whole}.{(frac or '0')[:6].ljust(6, '0')}{'+00:00' if zone == 'Z' else zone}")
    except ValueError:
        raise _bad(field, "must be an RFC 3339 time") from None
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def parse(body: bytes) -> list[Alert]:
    """The Keel alerts of one webhook call, in the order sent; InvalidInput when malformed."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _bad("body", "is not JSON") from None
    return from_doc(doc)


def from_doc(doc) -> list[Alert]:
    """The Keel alerts of a decoded v4 payload (webhook body, or one built from RotationAlert messages)."""
    if not isinstance(doc, dict):
        raise _bad("body", "must be a JSON object")
    if doc.get("version") != "4":
        raise _bad("version", 'must be "4"')
    raw = doc.get("alerts")
    if not isinstance(raw, list) or len(raw) > MAX_ALERTS:
        raise _bad("alerts", f"must be a list of at most {MAX_ALERTS}")
    out = []
    for i, a in enumerate(raw):
        field = f"alerts[{i}]"
        if not isinstance(a, dict):
            raise _bad(field, "must be an object")
        phase = a.get("status")
        if phase not in PHASES:
            raise _bad(f"{field}.status", f"must be one of {', '.join(PHASES)}")
        labels = _str_map(a.get("labels"), f"{field}.labels")
        annotations = _str_map(a.get("annotations", {}), f"{field}.annotations")
        if ACTION_LABEL not in labels:
            continue
        if not labels.get("alertname"):
            raise _bad(f"{field}.labels.alertname", "is missing")
        out.append(Alert(rule=labels["alertname"], action=labels[ACTION_LABEL], phase=phase,
                         fingerprint=_str(a, "fingerprint", field, max_len=64),
                         starts_at=canonical_time(_str(a, "startsAt", field, max_len=64), f"{field}.startsAt"),
                         labels=labels, annotations=annotations))
    return out
