"""The rotation executor: turns Alertmanager's alerts into recorded decisions and, in apply mode, actions.

For each Keel alert of a webhook call (services/feedback/rotation/alerts.py):
1. Claim its decision: the row keyed by (fingerprint, startsAt, phase). An alert seen before does
   nothing (Alertmanager repeats notifications, the stage restarts), except a decision left
   ``pending`` by a crash, which runs again (every action is idempotent).
2. Firing: within the action's cooldown after an applied or proposed one -> ``cooldown``; propose
   mode -> ``proposed``; apply mode -> the action, tried ``retry.attempts`` times with doubling
   backoff -> ``applied`` or ``failed``.
3. Resolved: a proposal never approved -> ``expired``; an applied reversible action
   (switch_variant) is undone (proposed first in propose mode); anything else -> ``skipped``.
``approve`` applies a proposed decision now, whatever the mode and the cooldown (a person decided).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.feedback.config import ROTATION_ACTIONS, Mode, RotationConfig
from services.feedback.rotation.actions import REVERSIBLE, Actions, NothingToDo
from services.feedback.rotation.alerts import Alert, Phase
from services.feedback.rotation.decisions import Decision, Decisions, Outcome
from services.feedback.store import now_ms
from shared import errors

log = logging.getLogger("keel.feedback.rotation")
ALERTMANAGER = "alertmanager"


class Executor:
    def __init__(self, cfg: RotationConfig, decisions: Callable[[], Decisions], actions: Actions, *,
                 on_decision: Callable[[Decision], None] = lambda d: None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.cfg = cfg
        self._decisions = decisions   # raises NotReady while the database is down
        self.actions = actions
        self._on_decision = on_decision
        self._sleep = sleep
        self._running: set[int] = set()

    async def _db(self, fn, *args, **kw):
        return await asyncio.to_thread(fn, *args, **kw)

    async def handle(self, alerts: list[Alert]) -> list[Decision]:
        """The decision of each alert, in order (new or as recorded before)."""
        return [await self.handle_one(a) for a in alerts]

    async def handle_one(self, alert: Alert) -> Decision:
        decisions = self._decisions()
        if alert.action not in ROTATION_ACTIONS:
            d, new = await self._db(decisions.claim, alert, self.cfg.mode, ALERTMANAGER, outcome=Outcome.SKIPPED,
                                    detail=f"unknown action {alert.action!r}; known: {', '.join(ROTATION_ACTIONS)}")
            return self._decided(d) if new else d
        d, new = await self._db(decisions.claim, alert, self.cfg.mode, ALERTMANAGER)
        if not new and not (d.outcome == Outcome.PENDING and d.id not in self._running):
            return d
        if alert.phase == Phase.FIRING:
            return await self._firing(decisions, d)
        return await self._resolved(decisions, alert, d)

    async def _firing(self, decisions: Decisions, d: Decision) -> Decision:
        cooldown_s = getattr(self.cfg.cooldown_s, d.action)
        last = await self._db(decisions.last_active, d.action, d.id)
        if last is not None:
            since = last.applied_ms or last.created_ms
            if now_ms() - since < cooldown_s * 1000:
                return self._decided(await self._db(
                    decisions.finish, d.id, Outcome.COOLDOWN,
                    detail=f"decision {last.id} ({last.outcome}) is within the {cooldown_s:g} s cooldown"))
        if self.cfg.mode == Mode.PROPOSE:
            return self._decided(await self._db(decisions.finish, d.id, Outcome.PROPOSED,
                                                detail="propose mode: `keel rotation approve ID` applies it"))
        return await self._apply(decisions, d, revert=False)

    async def _resolved(self, decisions: Decisions, alert: Alert, d: Decision) -> Decision:
        firing = await self._db(decisions.firing_of, alert)
        if firing is not None and firing.outcome == Outcome.PROPOSED:
            self._decided(await self._db(decisions.finish, firing.id, Outcome.EXPIRED, result=firing.result,
                                         detail=f"resolved (decision {d.id}) before it was approved"))
            return self._decided(await self._db(decisions.finish, d.id, Outcome.SKIPPED,
                                                detail=f"proposal {firing.id} expired: nothing was applied"))
        if firing is None or firing.outcome != Outcome.APPLIED or d.action not in REVERSIBLE:
            why = ("no firing decision was recorded" if firing is None else
                   f"decision {firing.id} is {firing.outcome}: nothing to undo" if firing.outcome != Outcome.APPLIED
                   else f"{d.action} is not undone when its alert resolves")
            return self._decided(await self._db(decisions.finish, d.id, Outcome.SKIPPED, detail=why))
        d = await self._db(decisions.set_reverts, d.id, firing.id)
        if self.cfg.mode == Mode.PROPOSE:
            return self._decided(await self._db(decisions.finish, d.id, Outcome.PROPOSED,
                                                detail=f"undo decision {firing.id}: `keel rotation approve` applies "
                                                       "it"))
        return await self._apply(decisions, d, revert=True)

    async def approve(self, decision_id: int, actor: str) -> Decision:
        if not actor.strip():
            raise errors.InvalidInput("an approval must name who approves", reason="MISSING_ACTOR")
        decisions = self._decisions()
        d = await self._db(decisions.take_proposal, decision_id, actor)
        return await self._apply(decisions, d, revert=d.phase == Phase.RESOLVED)

    async def _apply(self, decisions: Decisions, d: Decision, *, revert: bool) -> Decision:
        retry = self.cfg.retry
        backoff, last_error = retry.initial_backoff_s, ""
        self._running.add(d.id)
        try:
            for attempt in range(1, retry.attempts + 1):
                try:
                    result = await self.actions.run(decisions, d, revert=revert)
                except NothingToDo as exc:
                    return self._decided(await self._db(decisions.finish, d.id, Outcome.SKIPPED, detail=str(exc),
                                                        attempts=attempt))
                except (errors.KeelError, OSError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("rotation action failed", extra={"decision": d.id, "action": d.action,
                                                                 "attempt": attempt, "error": last_error})
                    if attempt < retry.attempts:
                        await self._sleep(backoff)
                        backoff = min(backoff * 2, retry.max_backoff_s)
                    continue
                what = f"undid decision {d.reverts}" if revert else "applied"
                return self._decided(await self._db(decisions.finish, d.id, Outcome.APPLIED, detail=what,
                                                    result=result, attempts=attempt, applied=True))
            return self._decided(await self._db(decisions.finish, d.id, Outcome.FAILED, attempts=retry.attempts,
                                                detail=f"{retry.attempts} tries failed; last: {last_error}"))
        finally:
            self._running.discard(d.id)

    async def dry_run(self, alerts: list[Alert]) -> list[dict]:
        """What handling each alert now would decide, recording and applying nothing."""
        decisions = self._decisions()
        out = []
        for a in alerts:
            verdict = {"rule": a.rule, "action": a.action, "phase": a.phase, "fingerprint": a.fingerprint}
            seen = await self._db(decisions.firing_of, a) if a.phase == Phase.FIRING else None
            last = await self._db(decisions.last_active, a.action, -1)
            cooldown_s = getattr(self.cfg.cooldown_s, a.action, None)
            if a.action not in ROTATION_ACTIONS:
                verdict["would"] = f"skip: unknown action {a.action!r}"
            elif seen is not None:
                verdict["would"] = f"nothing: already decided as {seen.id} ({seen.outcome})"
            elif last is not None and now_ms() - (last.applied_ms or last.created_ms) < cooldown_s * 1000:
                verdict["would"] = f"cooldown: decision {last.id} is within {cooldown_s:g} s"
            else:
                verdict["would"] = "propose" if self.cfg.mode == Mode.PROPOSE else "apply"
            out.append(verdict)
        return out

    def _decided(self, d: Decision) -> Decision:
        log.info("rotation decision", extra={k: getattr(d, k) for k in ("id", "rule", "action", "phase", "mode",
                                                                         "outcome", "detail", "actor")})
        self._on_decision(d)
        return d

