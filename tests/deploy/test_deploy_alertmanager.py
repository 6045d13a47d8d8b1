"""deploy/alertmanager: the config passes amtool, routes Keel's rotation alerts (and only them) to the
feedback stage's webhook with resolved notifications and the mesh token, and compose and Kubernetes
run it with that token at the path the config reads. amtool comes from Debian's prometheus-alertmanager
(make syspkgs); without it these tests FAIL, saying how to install it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.k8s_objects import OVERLAYS, WEBHOOK_PORT, container, one

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
TOKEN_FILE = "/run/secrets/mesh_token"


def amtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("amtool")
    assert exe, "amtool not found: install the Debian package `prometheus-alertmanager` (make syspkgs)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def test_amtool_accepts_the_config():
    done = amtool("check-config", str(CONFIG))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_amtool_catches_a_broken_config(tmp_path):
    bad = tmp_path / "am.yml"
    bad.write_text(CONFIG.read_text().replace("receiver: keel-rotation", "receiver: nobody"))
    assert amtool("check-config", str(bad)).returncode != 0


@pytest.mark.parametrize("labels,receiver", [
    (["alertname=KeelRotationSwitchToFallback", "keel_action=switch_variant", "variant=fallback"], "keel-rotation"),
    (["alertname=KeelRotationResampleData", "keel_action=resample_data"], "keel-rotation"),
    (["alertname=KeelStageNotServing", "severity=critical"], "null"),
])
def test_only_alerts_naming_an_action_reach_the_webhook(labels, receiver):
    done = amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels)
    assert done.returncode == 0 and done.stdout.split() == [receiver], done.stdout + done.stderr


def test_the_webhook_gets_resolved_alerts_with_the_mesh_token():
    cfg = yaml.safe_load(CONFIG.read_text())
    hook = next(r for r in cfg["receivers"] if r["name"] == "keel-rotation")["webhook_configs"]
    assert hook == [{"url": f"http://feedback:{WEBHOOK_PORT}/rotation/alerts", "send_resolved": True,
                     "http_config": {"authorization": {"type": "Bearer", "credentials_file": TOKEN_FILE}}}]
    assert next(r for r in cfg["route"]["routes"] if r["receiver"] == "keel-rotation")["group_by"] == ["..."]


def test_compose_runs_it_with_the_token_and_prometheus_sends_to_it():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    am = compose["services"]["alertmanager"]
    assert "./deploy/alertmanager:/etc/alertmanager:ro" in am["volumes"] and am["secrets"] == ["mesh_token"]
    assert compose["secrets"]["mesh_token"] == {"environment": "KEEL_MESH_TOKEN"}  # mounted at TOKEN_FILE
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert str(WEBHOOK_PORT) in compose["services"]["feedback"]["expose"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_mounts_the_generated_config_and_the_mesh_token(rendered, overlay):
    objs = rendered[overlay]
    dep = one(objs, "Deployment", "alertmanager")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["mesh-token"]["secret"] == {"secretName": volumes["mesh-token"]["secret"]["secretName"],
                                               "items": [{"key": "token", "path": "mesh_token"}]}
    assert volumes["mesh-token"]["secret"]["secretName"].startswith("keel-mesh")
    mounts = {m["name"]: m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert mounts["mesh-token"] + "/mesh_token" == TOKEN_FILE
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and
              o["metadata"]["name"] == volumes["config"]["configMap"]["name"])
    assert cm["data"]["alertmanager.yml"] == CONFIG.read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_feedback_pod_proposes_only_and_listens_where_alertmanager_posts(rendered, overlay):
    from tests.deploy.test_deploy_k8s_policy import SECRET_SAMPLES, effective_config, image_env

    objs = rendered[overlay]
    dep = one(objs, "Deployment", "feedback")
    env = dict(image_env("feedback"))
    env.update({e["name"]: e.get("value", SECRET_SAMPLES.get(e["name"], "")) for e in container(dep)["env"]})
    cm_name = next(v["configMap"]["name"] for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    rotation = effective_config("feedback", one(objs, "ConfigMap", cm_name)["data"]["feedback.yaml"], env)["rotation"]
    assert rotation["mode"] == "propose"   # nothing is applied until someone approves it
    assert (rotation["webhook_host"], rotation["webhook_port"]) == ("0.0.0.0", WEBHOOK_PORT)
    url = yaml.safe_load(CONFIG.read_text())["receivers"][1]["webhook_configs"][0]["url"]
    assert url == f"http://{dep['metadata']['name']}:{rotation['webhook_port']}/rotation/alerts"
    host, port = rotation["inference"][0].split(":")
    assert one(objs, "Service", host)["spec"]["clusterIP"] == "None"  # headless: every pod is switched
    assert int(port) in [p["port"] for p in one(objs, "Service", host)["spec"]["ports"]]
