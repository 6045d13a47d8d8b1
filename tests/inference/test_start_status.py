"""The inference stage's start-up as its stage status tells it (shared/stagestatus.py): the engine's
steps, the adapter checks, then the background quality gate's prompt count; on the tiny model."""
from __future__ import annotations

import asyncio

import pytest

from services.inference import bootstrap
from services.inference.config import InferenceConfig
from services.inference.formats.background import BackgroundGate
from services.inference.formats.quality import GateThresholds
from services.inference.formats.selection import FormatsConfig
from services.inference.formats.startgate import GateJob
from services.inference.model.digest import model_sha256
from shared import stagestatus
from tests.inference.helpers import tiny_config

pytestmark = pytest.mark.slow


class RecordingBoard(stagestatus.StatusBoard):
    """A board that also keeps every report, in order."""

    def __init__(self):
        super().__init__()
        self.reports: list[tuple] = []

    def phase(self, name, total=0):
        self.reports.append(("phase", name, total))
        super().phase(name, total)

    def advance(self, done):
        self.reports.append(("advance", self.snapshot().phase, done))
        super().advance(done)

    def step_done(self, name, seconds, resume):
        self.reports.append(("step", name, resume))
        super().step_done(name, seconds, resume)


def test_a_first_start_reports_each_step_then_the_background_gate_its_count(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    board = RecordingBoard()
    monkeypatch.setattr(stagestatus, "BOARD", board)
    lenient = GateThresholds(kl_mean_max=1e9, kl_p95_max=1e9, greedy_agreement_min=0)
    cfg = InferenceConfig(model_path=str(model_dir), engine=tiny_config(format="auto"), formats=FormatsConfig(
        auto_candidates=("float32", "bfloat16", "int8"), gate_prompts=5, gate=lenient))
    sha = model_sha256(cfg.model_dir)
    started = bootstrap.start_engine(cfg, sha)
    r = board.reports
    assert r[0] == ("phase", bootstrap.STARTING, 0)
    steps = [x[1] for x in r if x[0] == "step"]
    assert steps[:2] == ["load_model", "choose_format"] and "adapters" in steps
    assert not any("gating" in x[1] for x in r)  # the start does not wait for the gate
    assert any(x[0] == "phase" and x[1].startswith("checking ") and x[1].endswith(" adapter version(s)") for x in r)
    # after the last step the engine's phase resumes, with the step shown beside it
    assert (board.snapshot().phase, board.snapshot().last_step.split()[0]) == (bootstrap.STARTING, steps[-1])

    async def gate():  # then, serving, the real child gates the two candidates over 5 gate prompts
        await started.engine.start()
        try:
            job = GateJob(str(cfg.model_dir), sha, tuple(started.candidates.values()), cfg.formats, "cpu", 1, 4)
            await BackgroundGate(job, started.engine, started.candidates, board).run()
        finally:
            await started.engine.stop(grace_s=0)
    asyncio.run(gate())
    phase = "serving; gating bfloat16, int8 in the background"
    assert ("phase", phase, 5) in r
    assert [x[2] for x in r if x[0] == "advance" and x[1] == phase] == [1, 2, 3, 4, 5]
    assert board.snapshot().phase == "serving"
