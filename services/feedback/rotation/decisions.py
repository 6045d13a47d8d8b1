"""The rotation executor's records: one decision per (alert fingerprint, startsAt, phase), and the
retrain requests a decision made. Synchronous (SQLAlchemy Core); the executor calls it from threads.

Outcomes: ``pending`` (being executed), ``proposed`` (propose mode: waits for `keel rotation
approve`), ``applied``, ``failed`` (every try failed; nothing left half-applied), ``cooldown`` (the
same action ran too recently), ``skipped`` (nothing to do, with the reason in ``detail``),
``expired`` (a proposal whose alert resolved before anyone approved it).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from services.feedback import db
from services.feedback.rotation.alerts import Alert, Phase
from services.feedback.store import Store, now_ms
from shared import errors

_JSON = ("labels", "snapshot", "result")


class Outcome(StrEnum):
    """A decision's outcome as stored (the module docstring says what each means)."""

    PENDING = "pending"
    PROPOSED = "proposed"
    APPLIED = "applied"
    FAILED = "failed"
    COOLDOWN = "cooldown"
    SKIPPED = "skipped"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Decision:
    """One decision as stored (its table: services/feedback/db.py, rotation_decisions)."""

    id: int
    fingerprint: str          # the alert's, with starts_at and phase the decision's key
    starts_at: str
    phase: Phase
    rule: str                 # the alertname
    action: str               # one of config.ROTATION_ACTIONS (or an unknown one, skipped)
    labels: Mapping[str, str]
    snapshot: Mapping[str, str]   # the alert's annotations: the metric values it fired on
    mode: str                 # propose | apply, when it was decided
    outcome: Outcome
    detail: str
    result: Mapping[str, Any]     # what the action did
    actor: str
    attempts: int
    reverts: int | None       # the firing decision a resolved one undoes
    created_ms: int
    updated_ms: int
    applied_ms: int | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _row(r) -> Decision:
    d = dict(r._mapping)
    for k in _JSON:
        d[k] = json.loads(d[k])
    return Decision(**{**d, "phase": Phase(d["phase"]), "outcome": Outcome(d["outcome"])})


class Decisions:
    def __init__(self, store: Store):
        self.store = store
        self._t = db.rotation_decisions

    def claim(self, alert: Alert, mode: str, actor: str, *, outcome: Outcome = Outcome.PENDING, detail: str = "",
              reverts: int | None = None) -> tuple[Decision, bool]:
        """The decision of this alert phase: (row, True) when new, (the stored row, False) when the
        alert was seen before (Alertmanager repeats notifications; an executor restarts)."""
        t = now_ms()
        row = {"fingerprint": alert.fingerprint, "starts_at": alert.starts_at, "phase": alert.phase,
               "rule": alert.rule, "action": alert.action, "labels": json.dumps(alert.labels, sort_keys=True),
               "snapshot": json.dumps(alert.annotations, sort_keys=True), "mode": mode, "outcome": outcome,
               "detail": detail, "result": "{}", "actor": actor, "attempts": 0, "reverts": reverts,
               "created_ms": t, "updated_ms": t, "applied_ms": None}
        stmt = (self.store.insert(self._t).on_conflict_do_nothing(
            index_elements=["fingerprint", "starts_at", "phase"]).returning(self._t.c.id))
        with self.store.transaction() as conn:
            new_id = conn.execute(stmt, row).scalar_one_or_none()
            key = sa.and_(self._t.c.fingerprint == alert.fingerprint, self._t.c.starts_at == alert.starts_at,
                          self._t.c.phase == alert.phase)
            stored = conn.execute(sa.select(self._t).where(key)).one()
        return _row(stored), new_id is not None

    def get(self, decision_id: int) -> Decision:
        with self.store.transaction() as conn:
            r = conn.execute(sa.select(self._t).where(self._t.c.id == decision_id)).one_or_none()
        if r is None:
            raise errors.NotFound(f"no rotation decision has id {decision_id}", reason="DECISION_NOT_FOUND")
        return _row(r)

    def firing_of(self, alert: Alert) -> Decision | None:
        """The firing decision a resolved alert belongs to."""
        c = self._t.c
        q = sa.select(self._t).where(c.fingerprint == alert.fingerprint, c.starts_at == alert.starts_at,
                                     c.phase == Phase.FIRING)
        with self.store.transaction() as conn:
            r = conn.execute(q).one_or_none()
        return _row(r) if r is not None else None

    def last_active(self, action: str, exclude_id: int) -> Decision | None:
        """The newest firing decision of ``action`` that was applied or proposed (the cooldown's start)."""
        c = self._t.c
        q = (sa.select(self._t).where(c.action == action, c.phase == Phase.FIRING, c.id != exclude_id,
                                      c.outcome.in_((Outcome.APPLIED, Outcome.PROPOSED, Outcome.PENDING)))
             .order_by(c.id.desc()).limit(1))
        with self.store.transaction() as conn:
            r = conn.execute(q).one_or_none()
        return _row(r) if r is not None else None

    def take_proposal(self, decision_id: int, actor: str) -> Decision:
        """Proposed -> pending for ``actor`` (one approval wins); PreconditionFailed otherwise."""
        c = self._t.c
        with self.store.transaction() as conn:
            n = conn.execute(sa.update(self._t).where(c.id == decision_id, c.outcome == Outcome.PROPOSED)
                             .values(outcome=Outcome.PENDING, actor=actor, updated_ms=now_ms())).rowcount
        d = self.get(decision_id)
        if not n:
            raise errors.PreconditionFailed(f"decision {decision_id} is {d.outcome}, not proposed",
                                            reason="DECISION_NOT_PROPOSED", metadata={"outcome": d.outcome})
        return d

    def finish(self, decision_id: int, outcome: Outcome, *, detail: str = "", result: dict | None = None,
               attempts: int = 0, applied: bool = False) -> Decision:
        t = now_ms()
        values = {"outcome": outcome, "detail": detail, "result": json.dumps(result or {}, sort_keys=True),
                  "attempts": attempts, "updated_ms": t}
        if applied:
            values["applied_ms"] = t
        with self.store.transaction() as conn:
            conn.execute(sa.update(self._t).where(self._t.c.id == decision_id).values(**values))
        return self.get(decision_id)

    def set_reverts(self, decision_id: int, firing_id: int) -> Decision:
        """Link a resolved alert's decision to the firing decision it undoes."""
        with self.store.transaction() as conn:
            conn.execute(sa.update(self._t).where(self._t.c.id == decision_id).values(reverts=firing_id))
        return self.get(decision_id)

    def history(self, limit: int = 50, since_ms: int = 0) -> list[Decision]:
        c = self._t.c
        q = sa.select(self._t).where(c.created_ms >= since_ms).order_by(c.id.desc()).limit(limit)
        with self.store.transaction() as conn:
            return [_row(r) for r in conn.execute(q)]

    def with_outcome(self, outcome: Outcome, limit: int) -> list[Decision]:
        c = self._t.c
        q = sa.select(self._t).where(c.outcome == outcome).order_by(c.id.desc()).limit(limit)
        with self.store.transaction() as conn:
            return [_row(r) for r in conn.execute(q)]

    def add_retrain_requests(self, decision_id: int, adapters: list[tuple[str, str]]) -> None:
        """One request per adapter (name, version); a retried action adds none twice."""
        rows = [{"decision_id": decision_id, "adapter": a, "version": v, "status": "requested",
                 "created_ms": now_ms()} for a, v in adapters]
        if not rows:
            return
        stmt = self.store.insert(db.rotation_retrain_requests).on_conflict_do_nothing(
            index_elements=["decision_id", "adapter"])
        with self.store.transaction() as conn:
            conn.execute(stmt, rows)
