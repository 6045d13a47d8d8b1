"""The rotation executor on SQLite and on a real PostgreSQL, against fake inference replicas:
apply and propose modes, approval, idempotency across restarts, cooldowns, retries that fail
without leaving a replica half-switched, and the retrain and resample actions."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import pytest_asyncio
import sqlalchemy as sa
from prometheus_client import REGISTRY

from services.feedback import db
from services.feedback.config import CooldownConfig, FeedbackConfig, RetryConfig, RotationConfig
from services.feedback.rotation.alerts import Alert
from services.feedback.rotation.inference import InferenceFleet
from services.feedback.rotation.service import Rotation
from services.feedback.store import open_store
from shared import errors
from tests.feedback.fake_inference import FakeInference

TOKEN = "rotation-test-token"


@pytest.fixture(autouse=True)
def mesh_token(monkeypatch):
    monkeypatch.setenv("KEEL_MESH_TOKEN", TOKEN)


@pytest_asyncio.fixture
async def replicas():
    fakes = [await FakeInference(adapters=[("support-fr", "3")]).start(), await FakeInference().start()]
    yield fakes
    for f in fakes:
        await f.stop()


def alert(action="switch_variant", phase="firing", starts_at="2026-12-01T10:00:00Z", fingerprint="f1", **labels):
    labels = {"alertname": f"Rule-{action}", "keel_action": action, **labels}
    if action == "switch_variant":
        labels.setdefault("variant", "fallback")
    return Alert(rule=labels["alertname"], action=action, phase=phase, fingerprint=fingerprint, starts_at=starts_at,
                 labels=labels, annotations={"e2e_latency_p99_seconds": "3.1", "conditions": "x > 1"})


def applied_count() -> float:
    return REGISTRY.get_sample_value("keel_rotation_decisions_total",
                                     {"action": "switch_variant", "outcome": "applied"}) or 0.0


def retrain_requests(rotation, decision_id: int) -> list[tuple[str, str, str]]:
    t = db.rotation_retrain_requests
    with rotation.decisions().store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(t.c.adapter, t.c.version, t.c.status)
                                               .where(t.c.decision_id == decision_id).order_by(t.c.adapter))]


def make(db_url, replicas, tmp_path, *, mode="apply", cooldown=3600.0, attempts=3):
    sleeps: list[float] = []
    rot_cfg = RotationConfig(mode=mode, webhook_port=0, inference=tuple(r.target for r in replicas),
                             cooldown_s=CooldownConfig(cooldown, cooldown, cooldown),
                             retry=RetryConfig(attempts=attempts, initial_backoff_s=0.5, max_backoff_s=10))
    resample = replace(rot_cfg.resample, out_dir=str(tmp_path))
    cfg = replace(FeedbackConfig(), rotation=replace(rot_cfg, resample=resample))
    store = open_store(db_url)
    rotation = Rotation(cfg, lambda: store, InferenceFleet(rot_cfg.inference, 5.0))

    async def no_sleep(s: float) -> None:
        sleeps.append(s)
    rotation.executor._sleep = no_sleep
    return rotation, sleeps


@pytest.mark.asyncio
async def test_apply_switches_every_replica_once_and_the_resolved_alert_switches_back(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path)
    before = applied_count()
    d = await rotation.executor.handle_one(alert())
    assert (d.outcome, d.mode, d.actor, d.attempts) == ("applied", "apply", "alertmanager", 1)
    assert d.result["replicas"] == {r.target: {"previous": "primary", "active": "fallback"} for r in replicas}
    assert d.snapshot["e2e_latency_p99_seconds"] == "3.1" and d.labels["variant"] == "fallback"
    assert all(r.active == "fallback" and r.calls[0][2] == TOKEN for r in replicas)  # sent with the mesh token

    # Alertmanager repeats the notification, the stage restarts: nothing is applied again.
    again = await rotation.executor.handle_one(alert())
    restarted, _ = make(db_url, replicas, tmp_path)
    after_restart = await restarted.executor.handle_one(alert())
    assert again.id == after_restart.id == d.id
    assert [r.set_variant_calls() for r in replicas] == [["fallback"], ["fallback"]]
    assert applied_count() == before + 1   # counted once, not per delivery

    back = await restarted.executor.handle_one(alert(phase="resolved"))
    assert (back.outcome, back.reverts, back.detail) == ("applied", d.id, f"undid decision {d.id}")
    assert all(r.active == "primary" for r in replicas)
    history = await restarted.history(10, 0)
    assert [(h.id, h.phase, h.outcome) for h in history] == [
        (back.id, "resolved", "applied"), (d.id, "firing", "applied")]


@pytest.mark.asyncio
async def test_a_second_firing_inside_the_cooldown_does_nothing(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path)
    await rotation.executor.handle_one(alert())
    await rotation.executor.handle_one(alert(phase="resolved"))
    second = await rotation.executor.handle_one(alert(starts_at="2026-12-01T10:30:00Z"))
    assert second.outcome == "cooldown" and "within the 3600 s cooldown" in second.detail
    resolved = await rotation.executor.handle_one(alert(phase="resolved", starts_at="2026-12-01T10:30:00Z"))
    assert resolved.outcome == "skipped"
    assert [r.set_variant_calls() for r in replicas] == [["fallback", "primary"]] * 2
    status = await rotation.status()
    switch = next(c for c in status["cooldowns"] if c["action"] == "switch_variant")
    assert 3500 < switch["remaining_s"] <= 3600 and switch["last_decision_id"] == 1
    assert [r["active"] for r in status["replicas"]] == ["primary", "primary"]
    # no cooldown: the same action acts again
    free, _ = make(db_url, replicas, tmp_path, cooldown=0)
    assert (await free.executor.handle_one(alert(starts_at="2026-12-01T11:00:00Z"))).outcome == "applied"


@pytest.mark.asyncio
async def test_propose_records_and_applies_nothing_until_approved(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path, mode="propose")
    d = await rotation.executor.handle_one(alert())
    assert d.outcome == "proposed" and not any(r.set_variant_calls() for r in replicas)
    assert [p.id for p in (await rotation.status())["proposals"]] == [d.id]
    dry = await rotation.executor.dry_run([alert(starts_at="2026-12-01T12:00:00Z"), alert()])
    assert dry[0]["would"].startswith("cooldown") and dry[1]["would"].startswith("nothing: already decided")

    with pytest.raises(errors.InvalidInput) as exc:
        await rotation.executor.approve(d.id, " ")
    assert exc.value.reason == "MISSING_ACTOR"
    approved = await rotation.executor.approve(d.id, "alice")
    assert (approved.outcome, approved.actor) == ("applied", "alice")
    assert all(r.active == "fallback" for r in replicas)
    with pytest.raises(errors.PreconditionFailed) as exc:
        await rotation.executor.approve(d.id, "bob")
    assert exc.value.reason == "DECISION_NOT_PROPOSED" and exc.value.metadata["outcome"] == "applied"
    with pytest.raises(errors.NotFound) as exc:
        await rotation.executor.approve(999, "bob")
    assert exc.value.reason == "DECISION_NOT_FOUND"

    undo = await rotation.executor.handle_one(alert(phase="resolved"))
    assert undo.outcome == "proposed" and all(r.active == "fallback" for r in replicas)
    assert (await rotation.executor.approve(undo.id, "alice")).outcome == "applied"
    assert all(r.active == "primary" for r in replicas)


@pytest.mark.asyncio
async def test_a_proposal_whose_alert_resolves_unapproved_expires(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path, mode="propose")
    d = await rotation.executor.handle_one(alert())
    resolved = await rotation.executor.handle_one(alert(phase="resolved"))
    assert resolved.outcome == "skipped" and f"proposal {d.id} expired" in resolved.detail
    with pytest.raises(errors.PreconditionFailed):
        await rotation.executor.approve(d.id, "alice")
    assert (await rotation.history(10, 0))[1].outcome == "expired"
    assert not any(r.set_variant_calls() for r in replicas)


@pytest.mark.asyncio
async def test_a_failing_replica_is_retried_with_backoff_then_recorded_failed_never_half_switched(
        db_url, replicas, tmp_path):
    rotation, sleeps = make(db_url, replicas, tmp_path)
    replicas[1].fail_set_variant = -1
    d = await rotation.executor.handle_one(alert())
    assert (d.outcome, d.attempts) == ("failed", 3) and "3 tries failed" in d.detail
    assert sleeps == [0.5, 1.0]
    assert replicas[0].active == "primary"  # switched, then switched back each time
    assert replicas[0].set_variant_calls() == ["fallback", "primary"] * 3
    # a transient failure: the second try applies it
    replicas[1].fail_set_variant = 1
    retried, _ = make(db_url, replicas, tmp_path, cooldown=0)
    ok = await retried.executor.handle_one(alert(starts_at="2026-12-01T11:00:00Z"))
    assert (ok.outcome, ok.attempts) == ("applied", 2) and all(r.active == "fallback" for r in replicas)
    # the failed switch is not undone when its alert resolves: nothing was applied
    assert (await retried.executor.handle_one(alert(phase="resolved"))).outcome == "skipped"


@pytest.mark.asyncio
async def test_retrain_records_one_request_per_adapter_in_use(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path)
    d = await rotation.executor.handle_one(alert("retrain_adapters"))
    assert d.outcome == "applied" and d.result == {"retrain_requests": [{"adapter": "support-fr", "version": "3"}]}
    assert retrain_requests(rotation, d.id) == [("support-fr", "3", "requested")]
    labelled = await rotation.executor.handle_one(
        alert("retrain_adapters", fingerprint="f2", adapter="legal-de, support-fr", adapter_version="7"))
    assert labelled.outcome == "cooldown"
    free, _ = make(db_url, replicas, tmp_path, cooldown=0)
    labelled = await free.executor.handle_one(
        alert("retrain_adapters", fingerprint="f3", adapter="legal-de, support-fr", adapter_version="7"))
    assert [r[0] for r in retrain_requests(free, labelled.id)] == ["legal-de", "support-fr"]
    again = await free.executor.handle_one(
        alert("retrain_adapters", fingerprint="f3", adapter="legal-de, support-fr", adapter_version="7"))
    assert again.id == labelled.id and len(retrain_requests(free, labelled.id)) == 2
    # resolving never undoes a retrain request
    assert (await free.executor.handle_one(alert("retrain_adapters", phase="resolved"))).outcome == "skipped"


@pytest.mark.asyncio
async def test_retrain_without_adapters_is_skipped_and_an_unknown_action_is_recorded(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas[1:], tmp_path)   # the replica without an adapter registry
    d = await rotation.executor.handle_one(alert("retrain_adapters"))
    assert d.outcome == "skipped" and "no adapter is in use" in d.detail
    odd = await rotation.executor.handle_one(alert("reboot_everything", fingerprint="f9"))
    assert odd.outcome == "skipped" and "unknown action" in odd.detail


@pytest.mark.asyncio
async def test_resample_runs_the_etl_into_a_new_dataset(db_url, replicas, tmp_path):
    rotation, _ = make(db_url, replicas, tmp_path)
    d = await rotation.executor.handle_one(alert("resample_data"))
    assert d.outcome == "applied", d.detail
    out = tmp_path / f"rotation-{d.id}"
    manifest = json.loads((out / "manifest.json").read_text())
    assert d.result["dataset_version"] == manifest["dataset_version"] and d.result["out"] == str(out)
    assert manifest["split"]["seed"] == FeedbackConfig().etl.seed + d.id
