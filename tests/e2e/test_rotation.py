"""Metric-driven rotation, the whole loop with real parts: the mesh serves traffic, a real
Prometheus evaluates the switch_variant rule (generated from deploy/prometheus/rotation.yaml with
second-scale durations and a latency threshold every answer exceeds), a real Alertmanager delivers
to the feedback stage's webhook, the executor (apply mode) switches every inference replica to the
fallback variant, `keel rotation history` shows it, the resolved alert (traffic stopped) switches
back, and a second firing inside the cooldown does nothing.

The variant switch itself is the inference stage's: engine.variants (the preloaded fallback),
SetVariant and GetVariant. Without them the mesh of this test does not start (engine.variants is
an unknown config key), and with an inference stage that only lacks the RPCs the assertions on
"applied", on the variant GetVariant reports, and on "cooldown" (which runs from an applied
decision) fail: every switch is then recorded as failed.
"""
from __future__ import annotations

import importlib.util
import json
import threading

import grpc
import pytest

from keel.feedback.v1 import feedback_pb2, feedback_pb2_grpc
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keelctl.ask import DEV_API_KEY, build_request
from shared.meshauth import HEADER
from testing.mesh import start_mesh, stop_mesh, wait_until
from tests.e2e.alerting import ROOT, start_alertmanager, start_prometheus
from tests.e2e.test_cli import keel

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RULE = "KeelRotationSwitchToFallback"
LATENCY_THRESHOLD_S = 0.001  # the rule's p99 threshold here: every answer through the mesh is above it

_spec = importlib.util.spec_from_file_location("keel_build_rotation_rules",
                                               ROOT / "deploy" / "prometheus" / "build_rotation_rules.py")
builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(builder)


def e2e_rules() -> str:
    """The shipped switch rule with second-scale durations; any answer is over the latency threshold."""
    data = builder.load()
    rule = next(r for r in data["rules"] if r["alert"] == RULE)
    rule.update({"for": "2s", "keep_firing_for": "1s"})
    thresholds = {"e2e_latency_p99_seconds": (LATENCY_THRESHOLD_S, "5s"), "prefix_cache_hit_rate": (1.01, None)}
    for cond in rule["conditions"]:
        cond["threshold"], window = thresholds[cond["name"]]
        if window:
            cond["window"] = window
    data.update(gap_tolerance="3s", rules=[rule])
    return builder.render(data)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rotation")
    mesh = start_mesh(tmp, extra_env={"KEEL_FEEDBACK_ROTATION__MODE": "apply",
                                      "KEEL_FEEDBACK_ROTATION__COOLDOWN_S__SWITCH_VARIANT": "3600",
                                      "KEEL_FEEDBACK_ROTATION__RETRY__INITIAL_BACKOFF_S": "0.1",
                                      # the inference stage preloads the fallback variant (int8 has no
                                      # quality-gate result in this scratch var/, so it is forced)
                                      "KEEL_INFERENCE_ENGINE__VARIANTS__FALLBACK": "int8",
                                      "KEEL_INFERENCE_FORMATS__FORCE": "true"})
    procs = []
    try:
        token = tmp / "mesh_token"
        token.write_text(mesh.state()["mesh_token"])
        stages = mesh.layout["stages"]
        hook = stages["feedback"]["webhook_ports"][0]
        am, am_url = start_alertmanager(tmp, f"http://127.0.0.1:{hook}/rotation/alerts", token)
        procs.append(am)
        targets = [f"127.0.0.1:{p}" for s in ("gateway", "inference") for p in stages[s]["metrics_ports"]]
        prom, _ = start_prometheus(tmp, e2e_rules(), targets, am_url)
        procs.append(prom)
        yield mesh, am_url
    finally:
        for p in procs:
            p.stop()
        stop_mesh(mesh)


class Traffic:
    """Answers through the gateway, one after another, until stopped."""

    def __init__(self, mesh):
        self.mesh, self._stop = mesh, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with grpc.insecure_channel(self.mesh.gateway) as ch:
            stub = self.mesh.stub(ch)
            while not self._stop.is_set():
                stub.Generate(build_request("Name a colour.", max_tokens=4), metadata=(("x-api-key", DEV_API_KEY),),
                              timeout=120)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(150)


def decisions(mesh) -> list[feedback_pb2.RotationDecision]:
    md = ((HEADER, mesh.state()["mesh_token"]),)
    with grpc.insecure_channel(f"127.0.0.1:{mesh.ports['feedback'][0]}") as ch:
        got = feedback_pb2_grpc.FeedbackStub(ch).RotationHistory(feedback_pb2.RotationHistoryRequest(),
                                                                  metadata=md, timeout=30)
    return list(reversed(got.decisions))   # oldest first


def settled(mesh, phase: str, *, other_than: int = 0) -> list[feedback_pb2.RotationDecision]:
    """Decisions of ``phase`` whose action finished (not pending)."""
    return [d for d in decisions(mesh) if d.phase == phase and d.id != other_than and d.outcome != "pending"]


def variant(mesh) -> str:
    md = ((HEADER, mesh.state()["mesh_token"]),)
    with grpc.insecure_channel(f"127.0.0.1:{mesh.ports['inference'][0]}") as ch:
        return inference_pb2_grpc.InferenceStub(ch).GetVariant(inference_pb2.GetVariantRequest(), metadata=md,
                                                               timeout=30).active


def test_slow_answers_switch_to_the_fallback_and_back_and_a_second_firing_waits_for_the_cooldown(loop):
    mesh, alertmanager = loop
    traffic = Traffic(mesh)
    try:
        first = wait_until(lambda: settled(mesh, "firing"), 180, "the first firing")[0]
        # while the traffic (and so the alert) goes on, the fallback serves
        # (needs the inference stage's variants: see the module docstring)
        assert first.outcome == "applied", first.detail
        assert variant(mesh) == "fallback"
    finally:
        traffic.stop()
    assert (first.rule, first.action, first.mode, first.actor) == (RULE, "switch_variant", "apply", "alertmanager")
    # the snapshot holds the value the rule fired on: above the rule's threshold
    assert float(first.snapshot["e2e_latency_p99_seconds"]) > LATENCY_THRESHOLD_S
    assert first.labels["variant"] == "fallback"

    # No traffic: the p99 is unknown for longer than the gap tolerance, the alert resolves, the switch is undone.
    back = wait_until(lambda: settled(mesh, "resolved"), 120, "the resolved alert")[0]
    assert (back.outcome, back.reverts) == ("applied", first.id), back.detail
    assert variant(mesh) == "primary"

    out = keel(mesh, "rotation", "history")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert f"#{back.id}" in lines[0] and "[resolved] switch_variant -> applied" in lines[0]
    assert f"#{first.id}" in lines[1] and "[firing] switch_variant -> applied" in lines[1]

    traffic = Traffic(mesh)
    try:
        second = wait_until(lambda: settled(mesh, "firing", other_than=first.id), 180, "the second firing")[0]
        dry = keel(mesh, "rotation", "dry-run", "--alertmanager", alertmanager)   # the alert is still active
        assert dry.returncode == 0 and f"{RULE} (switch_variant, {second.fingerprint}): would nothing: already " \
            f"decided as {second.id} (cooldown)" in dry.stdout, dry.stdout + dry.stderr
    finally:
        traffic.stop()
    assert second.starts_at != first.starts_at
    assert second.outcome == "cooldown" and f"decision {first.id}" in second.detail
    assert variant(mesh) == "primary"
    status = keel(mesh, "rotation", "status")
    assert status.returncode == 0 and "mode: apply" in status.stdout and "variant primary" in status.stdout
    lines = keel(mesh, "rotation", "history", "--json").stdout.splitlines()
    history = {int(h["id"]): h for h in map(json.loads, lines)}
    assert history[second.id]["outcome"] == "cooldown" and history[first.id]["outcome"] == "applied"
