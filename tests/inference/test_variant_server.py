"""Variants on the real model through the real stage process (`python -m services.inference`):
SetVariant/GetVariant over gRPC, Finished.variant, the gauge, the spans, the log line with the actor,
a quality-gate refusal at start, and a restart that serves primary again from the warm record."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from keel.common.v1 import common_pb2
from keel.inference.v1 import inference_pb2, inference_pb2_grpc
from keelctl import health
from keelctl.trace import load_spans
from shared import client
from shared.interceptor import TRACE_ID_KEY
from shared.modelfile import source as model_source
from shared.stages import SERVICE_NAMES
from testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = model_source().cache_dir
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make model` first")]
PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


class Stage:
    """One inference stage process on free ports, its var/ and traces/ under a test folder."""

    def __init__(self, tmp: Path, **env):
        self.tmp, self.port, self.metrics_port = tmp, free_port(), free_port()
        self.env = {**os.environ, "KEEL_VAR_DIR": str(tmp / "var"), "KEEL_TRACES_DIR": str(tmp / "traces"),
                    "KEEL_INFERENCE_SERVER__PORT": str(self.port),
                    "KEEL_INFERENCE_SERVER__METRICS_PORT": str(self.metrics_port),
                    "KEEL_INFERENCE_ENGINE__FORMAT": "float32", "KEEL_INFERENCE_ENGINE__INTRA_OP_THREADS": "1",
                    "KEEL_INFERENCE_ENGINE__WARMUP_PROMPT_TOKENS": "[16, 64]",
                    "KEEL_INFERENCE_ENGINE__WARMUP_MAX_TOKENS": "32", **env}
        self.env.pop("KEEL_MESH_TOKEN", None)  # no token: the stage accepts any caller
        self.log_path = tmp / f"inference-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def run_to_exit(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.inference"], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=300)

    def start(self) -> Stage:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.inference"], cwd=ROOT, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        target = {"inference": (f"127.0.0.1:{self.port}", SERVICE_NAMES["inference"])}
        try:
            health.wait_serving(target, 600, lambda: self.proc.poll() is None)
        except TimeoutError:
            self.stop()
            raise AssertionError("stage did not come up:\n" + self.log_path.read_text()[-4000:])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def stub(self, channel) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(channel)

    def log(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def gauge(self, variant: str) -> float | None:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        for line in body.splitlines():
            if line.startswith(f'keel_inference_active_variant{{variant="{variant}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return None


def _generate(stub) -> tuple[inference_pb2.Finished, list[int], str]:
    call = stub.Generate(inference_pb2.GenerateRequest(
        prompt_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=6)), timeout=120)
    events = list(call)
    trace_id = dict(call.initial_metadata())[TRACE_ID_KEY]
    return events[-1].finished, [e.token.id for e in events[:-1]], trace_id


def _keel(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KEEL_KEEL_CONFIG=str(tmp / "keel.json"), KEEL_VAR_DIR=str(tmp / "cli-var"))
    env.pop("KEEL_MESH_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "keelctl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _eventually(check, timeout_s: float = 60):
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variant-stage")


def test_a_variant_format_without_a_gate_pass_stops_the_stage_naming_the_field(tmp):
    done = Stage(tmp, KEEL_INFERENCE_ENGINE__VARIANTS__FALLBACK="int8").run_to_exit()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "engine.variants.fallback" in done.stderr and "quality gate" in done.stderr


def test_a_breaker_fallback_format_without_a_gate_pass_stops_the_stage_naming_the_field(tmp):
    done = Stage(tmp, KEEL_INFERENCE_ENGINE__BREAKER__FALLBACK_FORMAT="int8").run_to_exit()
    assert done.returncode == 2, done.stderr[-2000:]
    assert "engine.breaker.fallback_format" in done.stderr and "quality gate" in done.stderr


def test_switching_the_real_model_over_grpc_and_serving_primary_again_after_a_restart(tmp):
    # int8 has no gate result in this scratch var/: formats.force serves it anyway (the start says so)
    env = {"KEEL_INFERENCE_ENGINE__VARIANTS__FALLBACK": "int8", "KEEL_INFERENCE_FORMATS__FORCE": "true"}
    stage = Stage(tmp, **env).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as ch:
            stub = stage.stub(ch)
            got = stub.GetVariant(inference_pb2.GetVariantRequest(), timeout=30)
            assert got.active == "primary" and dict(got.variants) == {"primary": "float32", "fallback": "int8"}
            before, _, _ = _generate(stub)
            assert (before.variant, before.engine["format"]) == ("primary", "float32")

            done = stub.SetVariant(inference_pb2.SetVariantRequest(variant="fallback", actor="rotation:42"), timeout=30)
            assert (done.active, done.previous) == ("fallback", "primary")
            after, _, trace_id = _generate(stub)
            assert (after.variant, after.engine["format"]) == ("fallback", "int8")
            again = stub.SetVariant(inference_pb2.SetVariantRequest(variant="fallback", actor="rotation:42"),
                                    timeout=30)
            assert (again.active, again.previous) == ("fallback", "fallback")

            with pytest.raises(grpc.RpcError) as bad:
                stub.SetVariant(inference_pb2.SetVariantRequest(variant="int4-tiny", actor="test"), timeout=30)
            err = client.translate(bad.value)
            assert (err.code, err.reason) == ("INVALID_ARGUMENT", "UNKNOWN_VARIANT")

        _eventually(lambda: stage.gauge("fallback") == 1.0 and stage.gauge("primary") == 0.0)
        _eventually(lambda: len([s for s in load_spans(trace_id, tmp / "traces") if s["service"] == "inference"]) >= 4)
        spans = [s for s in load_spans(trace_id, tmp / "traces") if s["service"] == "inference"]
        assert {s["name"] for s in spans} >= {"inference/Generate", "inference.queue", "inference.prefill",
                                              "inference.decode"}
        assert all(s["attributes"]["inference.variant"] == "fallback" for s in spans)
        switched = [r for r in stage.log() if r.get("msg") == "active variant switched"]
        assert [(r["variant"], r["previous"], r["actor"]) for r in switched] == [("fallback", "primary", "rotation:42")]

        # the same through `keel variant`, against a layout naming this stage
        layout = yaml.safe_load((ROOT / "config" / "keel.yaml").read_text())
        layout["stages"]["inference"].update(ports=[stage.port], metrics_ports=[stage.metrics_port])
        (tmp / "keel.json").write_text(json.dumps(layout))
        shown = _keel(tmp, "variant")
        assert shown.returncode == 0 and "active fallback" in shown.stdout and "fallback=int8" in shown.stdout
        back = _keel(tmp, "variant", "set", "primary", "--actor", "cli-test")
        assert back.returncode == 0 and "primary (was fallback)" in back.stdout
        unknown = _keel(tmp, "variant", "set", "nope")
        assert unknown.returncode == 1 and "UNKNOWN_VARIANT" in unknown.stderr
        _eventually(lambda: stage.gauge("primary") == 1.0 and stage.gauge("fallback") == 0.0)
    finally:
        stage.stop()

    # A restart serves primary (the rotation executor re-applies its decision) and reuses the warm
    # record, which covers both formats.
    restarted = Stage(tmp, **env).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{restarted.port}") as ch:
            assert restarted.stub(ch).GetVariant(inference_pb2.GetVariantRequest(), timeout=30).active == "primary"
            fin, _, _ = _generate(restarted.stub(ch))
            assert (fin.variant, fin.engine["format"]) == ("primary", "float32")
        warm = [r for r in restarted.log() if r.get("msg") == "engine warm"]
        assert warm and warm[0]["warm_start"] is True
        _eventually(lambda: restarted.gauge("primary") == 1.0 and restarted.gauge("fallback") == 0.0)
    finally:
        restarted.stop()
