"""What the rendered manifests mean at run time: who may reach whom (NetworkPolicy semantics,
evaluated here), and whether each stage's effective config (ConfigMap file + image ENV + pod env)
passes the stage's own schema with the stage's own env-override rules (shared/config.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import yaml

from shared import config as keel_config
from tests.deploy.dockerfiles import section
from tests.deploy.k8s_objects import OVERLAYS, ROOT, STAGES, TOPOLOGY, container, find, one

# --- NetworkPolicy evaluation --------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a connection comes from; labels=None means outside the cluster."""

    labels: dict | None
    namespace: str = "keel"
    namespace_labels: dict = field(default_factory=dict)


EXTERNAL = Source(None)


def selects(selector: dict, labels: dict) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for e in selector.get("matchExpressions", []):
        present, values = e["key"] in labels, e.get("values", [])
        if {"In": not (present and labels[e["key"]] in values), "NotIn": present and labels[e["key"]] in values,
                "Exists": not present, "DoesNotExist": present}[e["operator"]]:
            return False
    return True


def peer_admits(peer: dict, src: Source, policy_ns: str) -> bool:
    if src.labels is None or "ipBlock" in peer:
        return False  # Keel's policies open nothing by address
    ns_labels = {"kubernetes.io/metadata.name": src.namespace, **src.namespace_labels}
    ns_ok = selects(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer else src.namespace == policy_ns
    return ns_ok and ("podSelector" not in peer or selects(peer["podSelector"], src.labels))


def port_admits(ports: list | None, port: int, named: dict[str, int]) -> bool:
    return not ports or any(named.get(p["port"], p["port"]) == port for p in ports)


def allowed(objs: list[dict], dst: str, port: int, src: Source) -> bool:
    """Would the policies in ``objs`` let ``src`` open ``port`` on a pod of workload ``dst``?"""
    workload = (find(objs, "Deployment", dst) + find(objs, "StatefulSet", dst))[0]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
    policies = [p for p in find(objs, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    return any(port_admits(rule.get("ports"), port, named)
               and (not rule.get("from") or any(peer_admits(peer, src, p["metadata"]["namespace"])
                                                for peer in rule["from"]))
               for p in policies for rule in p["spec"].get("ingress", []))


def pod(objs: list[dict], name: str) -> Source:
    workload = (find(objs, "Deployment", name) + find(objs, "StatefulSet", name))[0]
    return Source(workload["spec"]["template"]["metadata"]["labels"])


INTERNAL = ("tokenizer", "inference", "validator")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_is_reachable_from_outside(rendered, overlay):
    objs = rendered[overlay]
    assert allowed(objs, "gateway", STAGES["gateway"][0], EXTERNAL)
    assert not allowed(objs, "gateway", STAGES["gateway"][1], EXTERNAL)  # its metrics port is not public
    for stage in INTERNAL:
        assert not allowed(objs, stage, STAGES[stage][0], EXTERNAL), stage
    assert not allowed(objs, "redis", 6379, EXTERNAL)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stages_accept_mesh_pods_only(rendered, overlay):
    objs = rendered[overlay]
    stranger = Source({"app": "debug-shell"})
    keel_label_elsewhere = Source({"app.kubernetes.io/part-of": "keel"}, namespace="default")
    for stage in INTERNAL:
        port = STAGES[stage][0]
        assert allowed(objs, stage, port, pod(objs, "gateway")), stage
        assert not allowed(objs, stage, port, stranger), stage
        assert not allowed(objs, stage, port, keel_label_elsewhere), stage


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_accepts_the_validator_only(rendered, overlay):
    objs = rendered[overlay]
    assert allowed(objs, "redis", 6379, pod(objs, "validator"))
    for other in ("gateway", "tokenizer", "inference"):
        assert not allowed(objs, "redis", 6379, pod(objs, other)), other


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_ports_accept_the_monitoring_namespace_only(rendered, overlay):
    objs = rendered[overlay]
    prometheus = Source({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    for stage, (port, mport, _svc) in STAGES.items():
        assert allowed(objs, stage, mport, prometheus), stage
        assert not allowed(objs, stage, mport, Source({"app": "x"}, namespace="default")), stage
        if stage != "gateway":
            assert not allowed(objs, stage, port, prometheus), stage


def test_the_evaluator_denies_when_a_policy_is_missing_its_rule(rendered):
    # Drop the gateway's public rule: the default deny must then close it.
    objs = [o for o in rendered["dev"] if o["metadata"]["name"] != "gateway-public"]
    assert not allowed(objs, "gateway", STAGES["gateway"][0], EXTERNAL)
    # Without the default deny and the stage policy, anything goes.
    objs = [o for o in objs if o["metadata"]["name"] not in ("default-deny-ingress", "stages-mesh-only",
                                                             "metrics-from-monitoring")]
    assert allowed(objs, "tokenizer", STAGES["tokenizer"][0], EXTERNAL)


# --- effective configuration -----------------------------------------------------------------------

SECRET_SAMPLES = {  # what the Secrets referenced by env hold, in the format the stage expects
    "KEEL_MESH_TOKEN": "0" * 64,
    "KEEL_PROXY_TOKEN": "0" * 64,
    "KEEL_GATEWAY_API_KEYS": "[{key_id: prod, key_hash: 'sha256$00000000000000000000000000000000$" + "0" * 64 + "'}]",
    "KEEL_FEEDBACK_DATABASE__URL": "postgresql+psycopg://keel:secret@postgres:5432/keel",
    "KEEL_REDIS_PASSWORD": "0" * 64,
}


def image_env(stage: str) -> dict[str, str]:
    """The KEEL_* ENV of the stage image's runtime stage."""
    env = {}
    for word, args in section(stage):
        if word == "ENV":
            for pair in args.split():
                key, _, value = pair.partition("=")
                if key.startswith("KEEL_"):
                    env[key] = value
    return env


def effective_config(stage: str, file_text: str, env: dict[str, str]) -> dict:
    """The stage's config after env overrides, validated against config/schemas/<stage>.schema.json."""
    schema = ROOT / "config" / "schemas" / f"{stage}.schema.json"
    assert schema.exists(), f"{schema.relative_to(ROOT)} is missing: cannot check {stage}'s config and env"
    overrides = {k: v for k, v in env.items() if k != f"KEEL_{stage.upper()}_CONFIG"}
    # the image's /app/config/keel.yaml is the repository's: the stage's ports when its file sets none
    data = keel_config._with_topology(yaml.safe_load(file_text) or {}, stage, {}, TOPOLOGY)
    data = keel_config._apply_env(data, stage, overrides)
    keel_config.validate(data, f"{stage}.schema.json", schema.parent)
    return data


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", STAGES)
def test_each_pod_config_passes_its_schema(rendered, overlay, stage):
    objs = rendered[overlay]
    dep = one(objs, "Deployment", stage)
    env = dict(image_env(stage))
    for e in container(dep)["env"]:
        # Kubernetes expands $(NAME) in a value from the variables listed before it.
        env[e["name"]] = (re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"]) if "value" in e
                          else SECRET_SAMPLES[e["name"]])
    cm_name = next(v["configMap"]["name"] for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    data = effective_config(stage, one(objs, "ConfigMap", cm_name)["data"][f"{stage}.yaml"], env)
    assert data["server"]["host"] == "0.0.0.0" and data["server"]["port"] == STAGES[stage][0]
    assert data["server"]["metrics_port"] == STAGES[stage][1]


@pytest.mark.parametrize("stage", STAGES)
def test_each_compose_service_config_passes_its_schema(stage):
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][stage]
    env = {**image_env(stage), **{k: str(v) for k, v in svc["environment"].items()}}
    path = ROOT / "config" / f"{stage}.yaml"
    assert path.exists(), f"config/{stage}.yaml is missing: compose mounts ./config"
    data = effective_config(stage, path.read_text(), env)
    assert data["server"]["host"] == "0.0.0.0"


def test_a_wrong_env_override_key_fails_the_schema():
    text = (ROOT / "config" / "gateway.yaml").read_text()
    with pytest.raises(keel_config.ConfigError, match="upstream"):
        effective_config("gateway", text, {"KEEL_GATEWAY_UPSTREAM__TOKENIZER": "[tokenizer:50052]"})
