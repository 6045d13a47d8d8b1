"""Alertmanager's webhook receiver: ``POST /rotation/alerts`` on the feedback stage's event loop.

Authenticated like every call inside the mesh, by the mesh token, which Alertmanager sends as
``Authorization: Bearer <token>`` (http_config.authorization.credentials_file). Answers:
200 with the decisions; 400 for a body that is not an Alertmanager v4 payload; 401 without the
right token; 503 while the database is down (Alertmanager retries, so nothing is lost). Every
refusal is logged with its reason.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from services.feedback.rotation import alerts
from services.feedback.rotation.decisions import Decision
from services.feedback.rotation.executor import Executor
from shared import errors, meshauth

log = logging.getLogger("keel.feedback.rotation")
PATH = "/rotation/alerts"
MAX_BODY_BYTES = 1 << 20
_STATUS = {errors.InvalidInput: 400, errors.Unauthenticated: 401, errors.NotReady: 503}


def _bearer(request: web.Request) -> str:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _summary(d: Decision) -> dict:
    return {k: getattr(d, k) for k in ("id", "rule", "action", "phase", "mode", "outcome", "detail")}


def make_app(executor: Executor, token: str, on_request: Callable[[int], None] = lambda code: None) -> web.Application:
    async def receive(request: web.Request) -> web.Response:
        try:
            meshauth.check(token, {meshauth.HEADER: _bearer(request)})
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise errors.InvalidInput(f"body over {MAX_BODY_BYTES} bytes", reason="INVALID_ALERT_PAYLOAD",
                                          metadata={"field": "body"}) from None
            decided = await executor.handle(alerts.parse(body))
        except errors.KeelError as exc:
            status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 500)
            log.warning("rotation webhook refused", extra={"status": status, "reason": exc.reason,
                                                           "error": str(exc), "peer": request.remote})
            on_request(status)
            return web.json_response({"reason": exc.reason, "message": str(exc), **exc.metadata}, status=status)
        on_request(200)
        return web.json_response({"decisions": [_summary(d) for d in decided]})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(PATH, receive)
    return app


class WebhookServer:
    """The receiver on its own port, run by the stage's asyncio loop."""

    def __init__(self, app: web.Application, host: str, port: int):
        self._runner = web.AppRunner(app, access_log=None)
        self.host, self.port = host, port

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        log.info("rotation webhook listening", extra={"url": f"http://{self.host}:{self.port}{PATH}"})

    async def close(self) -> None:
        await self._runner.cleanup()
