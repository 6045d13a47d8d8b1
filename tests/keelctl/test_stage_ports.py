"""Every port a stage binds comes from the mesh layout (config/keel.yaml): the supervisor hands each
worker its ports, and `keel up` / `keel doctor` check all of them, the feedback stage's rotation
webhook included."""
from __future__ import annotations

from keelctl.layout import Layout, StageLayout, StagesLayout
from keelctl.supervisor import Supervisor, layout_ports

LAYOUT = Layout(stages=StagesLayout(
    gateway=StageLayout(ports=(21001,)),
    feedback=StageLayout(ports=(21005, 21015), metrics_ports=(21106, 0), webhook_ports=(21107, 21117), workers=2)))


def test_layout_ports_name_each_replicas_webhook():
    ports = layout_ports(LAYOUT)
    assert (ports[21107], ports[21117]) == ("feedback-0 webhook", "feedback-1 webhook")
    assert (ports[21106], ports[21116]) == ("feedback-0.0 metrics", "feedback-0.1 metrics")


def test_each_feedback_replicas_first_worker_gets_its_webhook_port_the_others_none():
    sup = Supervisor(LAYOUT, redis=False)
    env = {c.name: c.env for c in sup.children if c.stage == "feedback"}
    sup.stop()  # nothing was started: closes its readiness socket
    assert {name: e["KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT"] for name, e in env.items()} == {
        "feedback-0.0": "21107", "feedback-0.1": "0", "feedback-1.0": "21117", "feedback-1.1": "0"}
    assert env["feedback-1.0"]["KEEL_FEEDBACK_SERVER__PORT"] == "21015"
    assert env["feedback-0.1"]["KEEL_FEEDBACK_SERVER__METRICS_PORT"] == "21116"
    assert env["feedback-1.1"]["KEEL_FEEDBACK_SERVER__METRICS_PORT"] == "0"
