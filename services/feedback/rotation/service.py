"""The rotation side of the feedback stage, assembled: executor, webhook, and the reads `keel rotation` uses."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.feedback.config import ROTATION_ACTIONS, FeedbackConfig
from services.feedback.rotation.actions import Actions
from services.feedback.rotation.decisions import Decision, Decisions, Outcome
from services.feedback.rotation.executor import Executor
from services.feedback.rotation.inference import InferenceFleet
from services.feedback.rotation.webhook import PATH, WebhookServer, make_app
from services.feedback.store import Store, now_ms
from shared import errors, meshauth, metrics

log = logging.getLogger("keel.feedback.rotation")
PROPOSALS_SHOWN = 50


class Rotation:
    def __init__(self, cfg: FeedbackConfig, store: Callable[[], Store], fleet: InferenceFleet | None = None):
        self.cfg = cfg.rotation
        m = metrics.metrics_for("feedback")
        decided, webhook = m.counter("keel_rotation_decisions_total"), m.counter("keel_rotation_webhook_requests_total")
        self.fleet = fleet or InferenceFleet(self.cfg.inference, self.cfg.call_timeout_s)
        self.decisions = lambda: Decisions(store())
        self.executor = Executor(self.cfg, self.decisions, Actions(self.cfg, cfg.etl, self.fleet),
                                 on_decision=lambda d: decided.labels(action=d.action, outcome=d.outcome).inc())
        self._on_request = lambda code: webhook.labels(code=str(code)).inc()
        self._server: WebhookServer | None = None

    @property
    def webhook_url(self) -> str:
        return f"http://{self.cfg.webhook_host}:{self.cfg.webhook_port}{PATH}" if self._server else ""

    async def start(self) -> None:
        token = meshauth.token()
        if not self.cfg.webhook_port:
            log.info("rotation webhook off (rotation.webhook_port: 0)")
            return
        if not token:
            # The webhook acts on the mesh: without a token to check it would take anyone's alerts.
            log.warning("rotation webhook off: no mesh token (KEEL_MESH_TOKEN) to authenticate Alertmanager")
            return
        server = WebhookServer(make_app(self.executor, token, self._on_request), self.cfg.webhook_host,
                               self.cfg.webhook_port)
        await server.start()
        self._server = server

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def status(self) -> dict:
        replicas = []
        try:
            targets = await self.fleet.replicas()
        except errors.KeelError as exc:
            targets = []
            replicas.append({"target": ", ".join(self.fleet.targets), "active": "", "error": str(exc)})
        for target in targets:
            try:
                active = (await self.fleet.get_variant(target)).active
                replicas.append({"target": target, "active": active, "error": ""})
            except errors.KeelError as exc:
                replicas.append({"target": target, "active": "", "error": f"{exc.reason}: {exc}"})
        decisions = self.decisions()
        cooldowns = []
        for action in ROTATION_ACTIONS:
            cooldown_s = float(getattr(self.cfg.cooldown_s, action))
            last = await asyncio.to_thread(decisions.last_active, action, -1)
            left = 0.0
            if last is not None:
                left = max(0.0, cooldown_s - (now_ms() - (last.applied_ms or last.created_ms)) / 1000)
            cooldowns.append({"action": action, "cooldown_s": cooldown_s, "remaining_s": left,
                              "last_decision_id": last.id if last else 0})
        proposals = await asyncio.to_thread(decisions.with_outcome, Outcome.PROPOSED, PROPOSALS_SHOWN)
        return {"mode": self.cfg.mode, "webhook_url": self.webhook_url, "replicas": replicas,
                "cooldowns": cooldowns, "proposals": proposals}

    async def history(self, limit: int, since_ms: int) -> list[Decision]:
        return await asyncio.to_thread(self.decisions().history, limit or 50, since_ms)
