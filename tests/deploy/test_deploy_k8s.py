"""deploy/k8s: every overlay renders, every object validates offline, and Keel's rules hold.

Rendering: `kubectl kustomize` (fails, never skips, without kubectl). Validation: kubernetes-validate
with its bundled schemas, strict (unknown fields are errors), for the oldest and newest Kubernetes
versions we claim.
"""
from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from shared.metrics import SPECS
from tests.deploy.k8s_objects import K8S, OVERLAYS, ROOT, STAGES, WEBHOOK_PORT, container, find, one

K8S_VERSIONS = ("1.30.0", "1.37.0")  # the grpc probe is GA since 1.27, autoscaling/v2 since 1.23
EXACT_TAG = re.compile(r":v?\d+\.\d+\.\d+([-.][\w.-]+)?$|@sha256:[0-9a-f]{64}$")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(rendered, overlay, version):
    errors = []
    for obj in rendered[overlay]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {getattr(exc, 'message', exc)}")
    assert errors == []


def test_the_validator_rejects_a_bad_object(rendered):
    dep = yaml.safe_load(yaml.safe_dump(one(rendered["dev"], "Deployment", "tokenizer")))
    container(dep)["readinessProbe"]["grpc"]["serivce"] = "typo"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_stage_has_deployment_service_hpa_and_pdb(rendered, overlay):
    objs = rendered[overlay]
    for stage in STAGES:
        one(objs, "Deployment", stage)
        one(objs, "Service", stage)
        assert one(objs, "HorizontalPodAutoscaler", stage)["apiVersion"] == "autoscaling/v2"
        assert one(objs, "PodDisruptionBudget", stage)["spec"]["maxUnavailable"] == 1
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {"keel"}


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", STAGES)
def test_probes_are_native_grpc_on_the_honest_health(rendered, overlay, stage):
    port, mport, service = STAGES[stage]
    c = container(one(rendered[overlay], "Deployment", stage))
    webhook = {"webhook": WEBHOOK_PORT} if stage == "feedback" else {}  # the rotation webhook (docs/rotation.md)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": port, "metrics": mport, **webhook}
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
    assert c["startupProbe"]["grpc"] == {"port": port, "service": service}
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    # Liveness must tolerate what readiness reports quickly: it waits at least a minute.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", STAGES)
def test_pods_are_non_root_read_only_with_requests_and_limits(rendered, overlay, stage):
    dep = one(rendered[overlay], "Deployment", stage)
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert "replicas" not in dep["spec"]  # the HPA owns the count
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), kind
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert "emptyDir" in volumes[mounts["/app/var/run"]["name"]]
    if stage == "inference":  # it stores the gate's results and its warm-start records under var/
        assert all("emptyDir" in volumes[mounts[p]["name"]] for p in ("/app/var/gate", "/app/var/warm"))
    config = mounts["/etc/keel"]
    assert config["readOnly"] is True and volumes[config["name"]]["configMap"]["name"].startswith("keel-config-")
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "keel"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("stage", STAGES)
def test_stage_reads_its_config_file_from_the_generated_configmap(rendered, overlay, stage):
    dep = one(rendered[overlay], "Deployment", stage)
    env = {e["name"]: e for e in container(dep)["env"]}
    assert env[f"KEEL_{stage.upper()}_CONFIG"]["value"] == f"/etc/keel/{stage}.yaml"
    assert env["KEEL_MESH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"
    # the proxy credential (shared/proxyauth.py) reaches the gateway, among the stages, only
    assert ("KEEL_PROXY_TOKEN" in env) == (stage == "gateway")
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    cm = one(rendered[overlay], "ConfigMap", volume["configMap"]["name"])
    assert f"{stage}.yaml" in cm["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_internal_stages_are_headless_for_client_side_round_robin(rendered, overlay):
    for stage, (port, _m, _s) in STAGES.items():
        svc = one(rendered[overlay], "Service", stage)
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"] == port
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": stage}
        if stage != "gateway":
            assert svc["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_upstreams_and_redis_url_name_real_services(rendered, overlay):
    objs = rendered[overlay]
    ports = {o["metadata"]["name"]: {p["port"] for p in o["spec"]["ports"]} for o in find(objs, "Service")}
    env = {e["name"]: e.get("value") for e in container(one(objs, "Deployment", "gateway"))["env"]}
    for stage in ("tokenizer", "inference", "validator"):
        targets = yaml.safe_load(env[f"KEEL_GATEWAY_UPSTREAMS__{stage.upper()}"])
        for target in targets:
            # inference by DNS name: the gateway routes to each pod of the headless Service
            assert target.startswith("dns:///") == (stage == "inference"), target
            host, port = target.removeprefix("dns:///").rsplit(":", 1)
            assert host == stage and int(port) in ports[host], target
    val = {e["name"]: e.get("value") for e in container(one(objs, "Deployment", "validator"))["env"]}
    url = re.fullmatch(r"redis://:\$\(KEEL_REDIS_PASSWORD\)@([\w.-]+):(\d+)/\d+",
                       val["KEEL_VALIDATOR_QUARANTINE__REDIS_URL"])
    assert url and int(url.group(2)) in ports[url.group(1)]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_requires_the_password_of_the_secret_and_the_validator_sends_it(rendered, overlay):
    objs = rendered[overlay]
    secret = "keel-redis"
    if overlay == "dev":
        (generated,) = [s for s in find(objs, "Secret") if s["metadata"]["name"].startswith("keel-redis-")]
        secret = generated["metadata"]["name"]
    redis_c = container(one(objs, "StatefulSet", "redis"))
    env = {e["name"]: e for e in redis_c["env"]}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "password"}
    script = " ".join(redis_c["command"] + redis_c["args"])
    assert '"$REDISCLI_AUTH" > /tmp/auth.conf' in script and "exec redis-server /tmp/auth.conf" in script
    assert "requirepass %s" in script and "maxmemory-policy noeviction" in script
    assert "grep -qx PONG" in " ".join(redis_c["readinessProbe"]["exec"]["command"])
    val = container(one(objs, "Deployment", "validator"))["env"]
    names = [e["name"] for e in val]
    # $(VAR) expands only from variables defined before it in the list.
    assert names.index("KEEL_REDIS_PASSWORD") < names.index("KEEL_VALIDATOR_QUARANTINE__REDIS_URL")
    assert val[names.index("KEEL_REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "password"}
    for obj in objs:                                  # the password is in no rendered object but dev's Secret
        if obj["kind"] != "Secret":
            assert "dev-only-redis-password" not in yaml.safe_dump(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaling(rendered, overlay):
    objs = rendered[overlay]
    for stage in STAGES:
        hpa = one(objs, "HorizontalPodAutoscaler", stage)["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": stage}
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
        if overlay != "dev" or stage == "gateway":  # two gateways everywhere: one goes on while one restarts
            assert hpa["minReplicas"] >= 2  # a PDB of maxUnavailable 1 then always leaves one serving
        (metric,) = hpa["metrics"]
        if stage == "inference":
            assert metric["type"] == "Pods"
            name = metric["pods"]["metric"]["name"]
            assert name == "keel_inference_queue_depth" and SPECS[name].owner == "inference"
            assert metric["pods"]["target"]["type"] == "AverageValue"
        else:
            assert metric == {"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_is_a_statefulset_with_a_persistent_volume(rendered, overlay):
    sts = one(rendered[overlay], "StatefulSet", "redis")["spec"]
    (claim,) = sts["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in sts["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert sts["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert one(rendered[overlay], "Service", "redis")["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_carry_explicit_tags_and_releases_exact_versions(rendered, overlay):
    for dep in find(rendered[overlay], "Deployment") + find(rendered[overlay], "StatefulSet"):
        image = container(dep)["image"]
        assert ":" in image.rsplit("/", 1)[-1], image
        if overlay != "dev" or dep["kind"] == "StatefulSet":
            assert EXACT_TAG.search(image), image


def test_dev_has_a_throwaway_mesh_token_and_releases_carry_no_credentials(rendered):
    secrets = {s["metadata"]["name"].rsplit("-", 1)[0]: s for s in find(rendered["dev"], "Secret")}
    assert set(secrets) == {"keel-mesh", "keel-feedback-db", "keel-redis"}
    assert "token" in secrets["keel-mesh"]["data"] and {"password", "url"} <= set(secrets["keel-feedback-db"]["data"])
    for overlay in ("prod", "gpu"):
        assert find(rendered[overlay], "Secret") == []
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in container(
            one(rendered[overlay], "Deployment", "gateway"))["env"] if "valueFrom" in e}
        assert refs == {"keel-mesh", "keel-gateway-api-keys"}


def test_prod_load_balancers_are_the_gateway_and_the_http_api_only(rendered):
    for overlay in ("prod", "gpu"):
        lbs = [s["metadata"]["name"] for s in find(rendered[overlay], "Service")
               if s["spec"].get("type") == "LoadBalancer"]
        assert sorted(lbs) == ["gateway", "openai"]
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in find(rendered["dev"], "Service"))


def test_gpu_overlay_gives_inference_a_gpu_and_cuda_and_nothing_else_a_gpu(rendered):
    objs = rendered["gpu"]
    inf = container(one(objs, "Deployment", "inference"))
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == "1" == inf["resources"]["requests"]["nvidia.com/gpu"]
    assert {"name": "KEEL_INFERENCE_ENGINE__DEVICE", "value": "cuda"} in inf["env"]
    assert inf["image"].startswith("keel/inference-cuda:")
    pod = one(objs, "Deployment", "inference")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for overlay in OVERLAYS:
        for dep in find(rendered[overlay], "Deployment"):
            if overlay != "gpu" or dep["metadata"]["name"] != "inference":
                assert "nvidia.com/gpu" not in str(container(dep)["resources"]), dep["metadata"]["name"]


def test_prometheus_adapter_serves_the_metric_the_hpa_asks_for():
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["seriesQuery"].startswith("keel_inference_queue_depth{")
    assert rule["name"]["as"] == "keel_inference_queue_depth"
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendered_configmap_is_config_itself(rendered, overlay):
    """One source of truth: the ConfigMap holds the repository's config files byte for byte."""
    (cm,) = [o for o in rendered[overlay]
             if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("keel-config-")]
    assert cm["data"] == {f"{s}.yaml": (ROOT / "config" / f"{s}.yaml").read_text() for s in (*STAGES, "openai")}
    assert cm["metadata"]["namespace"] == "keel"
