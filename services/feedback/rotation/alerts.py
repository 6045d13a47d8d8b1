"""Alertmanager's webhook payload (version 4) -> the alerts the rotation executor acts on.

Alertmanager POSTs ``{"version": "4", "status": ..., "alerts": [...], ...}``; each alert has
``status`` (firing | resolved), ``labels``, ``annotations``, ``startsAt``, ``endsAt`` and
``fingerprint``. Anything else is refused with INVALID_ALERT_PAYLOAD naming the field. An alert
without a ``keel_action`` label is not for Keel and is left out (the route only sends Keel's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from shared import errors

ACTION_LABEL = "keel_action"
PHASES = ("firing", "resolved")
MAX_ALERTS = 1000


@dataclass(frozen=True)
class Alert:
    rule: str                    # labels.alertname
    action: str                  # labels.keel_action
    phase: str                   # firing | resolved
    fingerprint: str
    starts_at: str               # RFC 3339, as Alertmanager sent it (part of the idempotency key)
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
                         starts_at=_str(a, "startsAt", field, max_len=64), labels=labels, annotations=annotations))
    return out
