"""The OpenAI-compatible HTTP stage in the deployments, offline: its image (the shared deps stage,
non-root, port 8080), its compose service (published 8080, HTTP health check, in front of the
gateway), its Kubernetes Service and probes on the http port, and the NetworkPolicy that opens that
port, and only that port, to clients outside Keel."""
from __future__ import annotations

import pytest
import yaml

from services.openai import config as openai_config
from tests.deploy.dockerfiles import section
from tests.deploy.k8s_objects import OVERLAYS, ROOT, STAGES, TOPOLOGY, container, one
from tests.deploy.test_deploy_containers import compose
from tests.deploy.test_deploy_k8s_policy import EXTERNAL, SECRET_SAMPLES, allowed, effective_config, image_env, pod

PORT = TOPOLOGY.ports("openai")[0]


def test_the_image_runs_the_stage_on_8080_from_the_shared_deps_stage():
    body = section("openai")
    words = dict(body)
    assert words["ENTRYPOINT"] == '["python", "-m", "services.openai"]' and words["EXPOSE"].split() == [str(PORT)]
    assert openai_config.load(environ={}).server.port == PORT
    env = " ".join(args for word, args in body if word == "ENV")
    assert "KEEL_OPENAI_SERVER__HOST=0.0.0.0" in env and words["USER"] == "10001:10001"
    assert "COPY --from=deps /app/.venv .venv" in [f"{w} {a}" for w, a in body]  # the light venv, no torch


def test_compose_publishes_8080_in_front_of_the_gateway():
    svc = compose()["services"]["openai"]
    assert svc["build"]["args"] == {"STAGE": "openai"} and svc["ports"] == [f"{PORT}:{PORT}"]
    assert svc["environment"]["KEEL_OPENAI_GATEWAY"] == f"[gateway:{STAGES['gateway'][0]}]"
    # it calls the gateway with the caller's key only, and names the caller with the proxy credential
    assert "KEEL_MESH_TOKEN" not in svc["environment"] and "KEEL_PROXY_TOKEN" in svc["environment"]
    assert sorted(svc["networks"]) == ["edge", "mesh"]
    assert svc["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert svc["healthcheck"]["test"] == ["CMD", "python", "/app/healthcheck.py", "--port", str(PORT),
                                          "--http", "/health"]
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"] and "./config:/app/config:ro" in svc["volumes"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_service_and_probes_use_the_http_port(rendered, overlay):
    objs = rendered[overlay]
    (port,) = one(objs, "Service", "openai")["spec"]["ports"]
    assert (port["name"], port["port"], port["targetPort"], port["appProtocol"]) == ("http", PORT, "http", "http")
    c = container(one(objs, "Deployment", "openai"))
    assert c["ports"] == [{"name": "http", "containerPort": PORT}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"port": "http", "path": "/health"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KEEL_OPENAI_GATEWAY"] == f"[gateway:{STAGES['gateway'][0]}]" and "KEEL_MESH_TOKEN" not in env
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert list(secrets) == ["KEEL_PROXY_TOKEN"] and secrets["KEEL_PROXY_TOKEN"]["key"] == "proxy-token"
    assert secrets["KEEL_PROXY_TOKEN"]["name"].startswith("keel-mesh")  # dev's generated name has a hash suffix
    assert env["KEEL_OPENAI_CONFIG"] == "/etc/keel/openai.yaml"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_opens_the_http_port_to_clients_and_it_reaches_the_gateway(rendered, overlay):
    objs = rendered[overlay]
    assert allowed(objs, "openai", PORT, EXTERNAL)
    assert not allowed(objs, "openai", 9999, EXTERNAL)
    assert allowed(objs, "gateway", STAGES["gateway"][0], pod(objs, "openai"))
    for stage in ("tokenizer", "inference", "validator"):
        assert not allowed(objs, stage, STAGES[stage][0], EXTERNAL), stage


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_config_passes_the_schema(rendered, overlay):
    objs = rendered[overlay]
    dep = one(objs, "Deployment", "openai")
    env = {**image_env("openai"),
           **{e["name"]: e.get("value", SECRET_SAMPLES.get(e["name"])) for e in container(dep)["env"]}}
    cm_name = next(v["configMap"]["name"] for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    data = effective_config("openai", one(objs, "ConfigMap", cm_name)["data"]["openai.yaml"], env)
    assert data["server"]["host"] == "0.0.0.0" and data["server"]["port"] == PORT
    assert data["gateway"] == [f"gateway:{STAGES['gateway'][0]}"]


def test_the_compose_config_passes_the_schema():
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["openai"]
    env = {**image_env("openai"), **{k: str(v) for k, v in svc["environment"].items()}}
    data = effective_config("openai", (ROOT / "config" / "openai.yaml").read_text(), env)
    assert data["server"]["host"] == "0.0.0.0" and data["gateway"] == [f"gateway:{STAGES['gateway'][0]}"]
