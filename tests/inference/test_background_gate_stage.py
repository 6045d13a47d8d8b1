"""The first start of the real stage process with `auto` and an empty var/: it serves at once on
float32 while int8 is gated in the background, answers before the gate ends, shows the gate's
progress in its stage status, then switches to what auto chooses (or keeps float32 where int8 loses
on this host); a reply served before a switch and one after it are "not comparable" for a replay,
naming the format. A restart finds the results stored and serves the winner from the start."""
from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from keel.inference.v1 import inference_pb2
from keel.stage.v1 import stage_pb2, stage_pb2_grpc
from services.feedback.records import ReplayRecord
from services.feedback.replay import compare
from testing.records import record
from tests.inference.test_variant_server import MODEL, PROMPT, Stage, _generate

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make model` first")]
ENV = {"KEEL_INFERENCE_ENGINE__FORMAT": "auto", "KEEL_INFERENCE_FORMATS__GATE_AT_START": "true",
       "KEEL_INFERENCE_FORMATS__GATE_PROMPTS": "4", "KEEL_INFERENCE_FORMATS__AUTO_CANDIDATES": '["float32", "int8"]'}
GATING = "serving; gating int8 in the background"


def _phase(channel) -> stage_pb2.GetStatusResponse:
    return stage_pb2_grpc.StageStatusStub(channel).GetStatus(stage_pb2.GetStatusRequest(), timeout=30)


def _record(fin: inference_pb2.Finished, output: list[int]) -> ReplayRecord:
    """A replay record of this answer: its engine facts, prompt and output are what compare() reads."""
    return replace(record("t" * 32, prompt=PROMPT, output=output), engine=dict(fin.engine))


def test_a_first_start_answers_before_the_background_gate_ends_then_switches_to_the_winner(tmp_path):
    stage = Stage(tmp_path, **ENV).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as ch:
            stub = stage.stub(ch)
            assert dict(stub.GetVariant(inference_pb2.GetVariantRequest(), timeout=30).variants) == {
                "primary": "float32", "auto-int8": "int8"}
            before, before_ids, _ = _generate(stub)
            assert (before.variant, before.engine["format"]) == ("primary", "float32")
            assert _phase(ch).phase == GATING  # answered while the gate still runs
            end = time.monotonic() + 400
            seen_total = 0
            while (status := _phase(ch)).phase == GATING:
                seen_total = max(seen_total, status.total)
                assert time.monotonic() < end, "the background gate did not end"
                time.sleep(0.5)
            assert status.phase == "serving"
            active = stub.GetVariant(inference_pb2.GetVariantRequest(), timeout=30).active
            after, after_ids, _ = _generate(stub)
        assert (tmp_path / "var" / "gate").is_dir()
        messages = [r.get("msg") for r in stage.log()]
        assert "quality gate run" in messages
        if "background quality gate: switched to the format auto chose" in messages:
            assert active == "auto-int8" and (after.variant, after.engine["format"]) == ("auto-int8", "int8")
            outcome = compare(_record(before, before_ids), _record(after, after_ids))
            assert outcome.result == "not_comparable" and "engine.format" in outcome.fields
            switched = [r for r in stage.log() if r.get("msg") == "active variant switched"]
            assert [(r["variant"], r["actor"]) for r in switched] == [("auto-int8", "auto quality gate")]
        else:
            assert "background quality gate: keeping the served format" in messages
            assert active == "primary" and after.engine["format"] == "float32"
        assert seen_total in (0, 4)  # when a poll caught the scoring, it counted the 4 gate prompts
    finally:
        stage.stop()

    restarted = Stage(tmp_path, **ENV).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{restarted.port}") as ch:
            variants = restarted.stub(ch).GetVariant(inference_pb2.GetVariantRequest(), timeout=30).variants
            # the winner, from the start
            assert "auto-int8" not in variants and variants["primary"] == after.engine["format"]
            assert _phase(ch).phase == "serving"
    finally:
        restarted.stop()
