"""The rotation webhook over real HTTP: Alertmanager's v4 payload taken, malformed bodies refused
with 400, callers without the mesh token refused with 401, each refusal logged."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import aiohttp
import pytest
import pytest_asyncio

from services.feedback.config import FeedbackConfig, RotationConfig
from services.feedback.rotation.service import Rotation
from services.feedback.store import open_store
from testing.ports import free_port
from tests.feedback.fake_inference import FakeInference

TOKEN = "rotation-webhook-token"


def payload(status="firing", **alert) -> dict:
    a = {"status": status, "labels": {"alertname": "KeelRotationSwitchToFallback", "keel_action": "switch_variant",
                                      "variant": "fallback", "severity": "warning"},
         "annotations": {"e2e_latency_p99_seconds": "2.5"}, "startsAt": "2026-12-01T10:00:00.123Z",
         "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus/graph", "fingerprint": "a1b2c3d4e5f60718"}
    a.update(alert)
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": status, "receiver": "keel",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
            "alerts": [a, {"status": "firing", "labels": {"alertname": "NotKeels"}, "annotations": {},
                           "startsAt": "2026-12-01T10:00:00Z", "fingerprint": "ffff"}]}


@pytest_asyncio.fixture
async def webhook(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_MESH_TOKEN", TOKEN)
    replica = await FakeInference().start()
    port = free_port()
    cfg = replace(FeedbackConfig(), rotation=RotationConfig(mode="apply", webhook_port=port,
                                                            inference=(replica.target,)))
    store = open_store(f"sqlite:///{tmp_path / 'feedback.db'}")
    rotation = Rotation(cfg, lambda: store)
    await rotation.start()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
        yield http, rotation, replica
    await rotation.close()
    await replica.stop()


async def post(http, body, token=TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post("/rotation/alerts", data=data, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_a_firing_then_resolved_alert_is_applied_and_undone(webhook):
    http, rotation, replica = webhook
    status, body = await post(http, payload())
    assert status == 200 and [(d["action"], d["outcome"]) for d in body["decisions"]] == [("switch_variant", "applied")]
    assert replica.active == "fallback"
    # a repeated notification, with startsAt in nanoseconds (the v2 API has milliseconds): the same alert
    status, body = await post(http, payload(startsAt="2026-12-01T11:00:00.123456789+01:00"))
    assert status == 200 and body["decisions"][0]["id"] == 1 and replica.set_variant_calls() == ["fallback"]
    status, body = await post(http, payload("resolved", endsAt="2026-12-01T11:00:00Z"))
    assert status == 200 and body["decisions"][0]["outcome"] == "applied" and replica.active == "primary"
    assert rotation.webhook_url.endswith("/rotation/alerts")


@pytest.mark.asyncio
@pytest.mark.parametrize("token", [None, "", "wrong"])
async def test_a_caller_without_the_mesh_token_gets_401_and_is_logged(webhook, token, caplog):
    http, rotation, replica = webhook
    with caplog.at_level(logging.WARNING, logger="keel.feedback.rotation"):
        status, body = await post(http, payload(), token=token)
    assert status == 401 and body["reason"] in ("MISSING_MESH_CREDENTIAL", "INVALID_MESH_CREDENTIAL")
    assert any(r.getMessage() == "rotation webhook refused" and r.status == 401 for r in caplog.records)
    assert replica.calls == [] and await rotation.history(10, 0) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("body,field", [
    (b"{not json", "body"),
    ([1, 2], "body"),
    ({"version": "3", "alerts": []}, "version"),
    ({"version": "4", "alerts": {}}, "alerts"),
    ({"version": "4", "alerts": ["x"]}, "alerts[0]"),
    (payload(status="maybe"), "alerts[0].status"),
    (payload(labels={"alertname": "A", "keel_action": 3}), "alerts[0].labels"),
    (payload(fingerprint=""), "alerts[0].fingerprint"),
    (payload(startsAt=None), "alerts[0].startsAt"),
    (payload(startsAt="yesterday"), "alerts[0].startsAt"),
    (payload(startsAt="2026-13-01T10:00:00Z"), "alerts[0].startsAt"),
    (payload(labels={"keel_action": "switch_variant"}), "alerts[0].labels.alertname"),
    (b"x" * (2 << 20), "body"),
])
async def test_a_malformed_payload_gets_400_naming_the_field_and_is_logged(webhook, body, field, caplog):
    http, rotation, replica = webhook
    with caplog.at_level(logging.WARNING, logger="keel.feedback.rotation"):
        status, answer = await post(http, body)
    assert status == 400 and answer["reason"] == "INVALID_ALERT_PAYLOAD" and answer["field"] == field
    assert any(r.getMessage() == "rotation webhook refused" and r.status == 400 for r in caplog.records)
    assert replica.calls == [] and await rotation.history(10, 0) == []


@pytest.mark.asyncio
async def test_the_database_down_answers_503_so_alertmanager_retries(tmp_path, monkeypatch):
    from shared import errors

    monkeypatch.setenv("KEEL_MESH_TOKEN", TOKEN)
    port = free_port()
    cfg = replace(FeedbackConfig(), rotation=RotationConfig(mode="apply", webhook_port=port, inference=()))

    def down():
        raise errors.NotReady("the feedback database is unavailable", reason="DATABASE_UNAVAILABLE")
    rotation = Rotation(cfg, down)
    await rotation.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            status, body = await post(http, payload())
        assert status == 503 and body["reason"] == "DATABASE_UNAVAILABLE"
    finally:
        await rotation.close()
