"""The validator stage as a real process against a real redis-server that requires a password:
the right password serves; a wrong or missing one keeps the stage NOT_SERVING with one clear
log line (no traceback, no password), and it serves once Redis accepts the credentials."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from keelctl import health
from shared.stages import SERVICE_NAMES
from testing.ports import free_port
from tests.validator.conftest import RedisServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret-" + "ab" * 16


@pytest.fixture
def redis_with_password(tmp_path):
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, persistent=False, password=PASSWORD)
    server.start()
    yield server
    server.stop()


def start_validator(tmp_path: Path, redis_url: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / f"validator-{port}.log"
    env = dict(os.environ, KEEL_VAR_DIR=str(tmp_path / "var"), KEEL_TRACES_DIR=str(tmp_path / "traces"),
               KEEL_VALIDATOR_SERVER__PORT=str(port), KEEL_VALIDATOR_SERVER__METRICS_PORT="0",
               KEEL_VALIDATOR_QUARANTINE__REDIS_URL=redis_url,
               KEEL_VALIDATOR_QUARANTINE__SPILL_PATH=str(tmp_path / f"spill-{port}.jsonl"))
    env.pop("KEEL_MESH_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "services.validator"], cwd=ROOT, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}", log


def status(target: str) -> int | None:
    try:
        with grpc.insecure_channel(target) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAMES["validator"]), timeout=2).status
    except grpc.RpcError:
        return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def refusals(log: Path) -> list[dict]:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [r for r in records if "refused the quarantine's credentials" in r.get("msg", "")]


def test_the_right_password_serves(tmp_path, redis_with_password):
    proc, target, _ = start_validator(tmp_path, redis_with_password.url)
    try:
        health.wait_serving({"validator": (target, SERVICE_NAMES["validator"])}, 90, lambda: proc.poll() is None)
    finally:
        stop(proc)


@pytest.mark.parametrize("credentials", ["wrong", "missing"])
def test_a_wrong_or_missing_password_is_not_serving_with_a_clear_log_line(tmp_path, redis_with_password, credentials):
    port = redis_with_password.port
    url = (f"redis://:not-the-password@127.0.0.1:{port}/0" if credentials == "wrong"
           else f"redis://127.0.0.1:{port}/0")
    proc, target, log = start_validator(tmp_path, url)
    try:
        deadline = time.monotonic() + 90
        while not refusals(log):
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no refusal logged:\n" + log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(5)                                     # two more retries: still one line, still not serving
        assert status(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert proc.poll() is None
        text = log.read_text()
        assert len(refusals(log)) == 1 and "Traceback" not in text and PASSWORD not in text
        assert "not-the-password" not in text
        expected = "invalid username-password pair" if credentials == "wrong" else "authenticated"
        assert expected in refusals(log)[0]["redis_error"]
        admin = redis.Redis.from_url(redis_with_password.url)     # the credentials fixed on Redis's side
        admin.config_set("requirepass", "not-the-password" if credentials == "wrong" else "")
        admin.close()
        health.wait_serving({"validator": (target, SERVICE_NAMES["validator"])}, 30, lambda: proc.poll() is None)
    finally:
        stop(proc)
