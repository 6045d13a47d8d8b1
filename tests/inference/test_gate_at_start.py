"""`auto` serves at once and gates its ungated candidates in the background (startgate.py in a child
process, background.py), stores the results, switches to what it then chooses, and a later start reads
them instead of gating again; on the tiny model with a few of the stored prompts."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging

import pytest

from services.inference import bootstrap, server
from services.inference import config as inf_config
from services.inference.config import InferenceConfig
from services.inference.engine.variants import Switch
from services.inference.formats import background, gateprompts, quality, selection
from services.inference.formats.background import BackgroundGate
from services.inference.formats.quality import GateThresholds
from services.inference.formats.selection import FormatsConfig
from services.inference.formats.startgate import GateJob
from services.inference.model.digest import model_sha256
from shared.config import ConfigError
from shared.errors import PreconditionFailed
from shared.stagestatus import StatusBoard
from tests.inference.helpers import measured, tiny_config

pytestmark = pytest.mark.slow

LENIENT = GateThresholds(kl_mean_max=1e9, kl_p95_max=1e9, greedy_agreement_min=0)  # every format passes
STRICT = GateThresholds(kl_mean_max=0, kl_p95_max=0, greedy_agreement_min=1)  # only bit-equal ones pass
CANDIDATES = {"auto-bfloat16": "bfloat16", "auto-int8": "int8"}


@pytest.fixture
def gate_runs(monkeypatch):
    """Each call of the gate's scoring: the formats it scored and how many sequences."""
    calls, evaluate = [], quality.evaluate

    def counting(reference, candidates, sequences, progress=None):
        calls.append((sorted(candidates), len(sequences)))
        return evaluate(reference, candidates, sequences, progress)
    monkeypatch.setattr(quality, "evaluate", counting)
    return calls


def _cfg(model_dir, **fmt) -> InferenceConfig:
    values = {"auto_candidates": ("float32", "bfloat16", "int8"), "gate_prompts": 6, "gate": LENIENT, **fmt}
    return InferenceConfig(model_path=str(model_dir), engine=tiny_config(format="auto"),
                           formats=FormatsConfig(**values))


def _start(cfg: InferenceConfig) -> bootstrap.Started:
    return bootstrap.start_engine(cfg, model_sha256(cfg.model_dir))


def _stored(cfg: InferenceConfig) -> dict[str, quality.GateResult]:
    sha = model_sha256(cfg.model_dir)
    return quality.load(selection.gate_path(sha), sha)


def _job(cfg: InferenceConfig, formats: tuple[str, ...]) -> GateJob:
    return GateJob(str(cfg.model_dir), model_sha256(cfg.model_dir), formats, cfg.formats, "cpu", 1,
                   cfg.engine.max_batch_size)


def _gate(cfg: InferenceConfig, started: bootstrap.Started) -> background.Outcome:
    """The real child (python -m services.inference.formats.startgate) gating what the start left."""
    async def go():
        await started.engine.start()
        try:
            return await BackgroundGate(_job(cfg, tuple(started.candidates.values())), started.engine,
                                        started.candidates, StatusBoard()).run()
        finally:
            await started.engine.stop(grace_s=0)
    return asyncio.run(go())


def test_a_first_start_serves_the_reference_with_the_ungated_candidates_preloaded_and_locked(var_dir, model_dir,
                                                                                           gate_runs):
    started = _start(_cfg(model_dir))
    assert gate_runs == [] and not _stored(_cfg(model_dir))  # nothing gated before serving
    assert started.record.format == "float32" and started.candidates == CANDIDATES
    assert {k: v for k, v in started.engine.variants.items() if k != "primary"} == CANDIDATES
    assert selection.GATING in started.record.reason

    async def refused():
        await started.engine.start()
        try:
            await started.engine.set_variant("auto-int8", "operator")
        finally:
            await started.engine.stop(grace_s=0)
    with pytest.raises(PreconditionFailed, match="quality gate"):
        asyncio.run(refused())


def test_the_background_gate_stores_the_results_and_switches_to_what_auto_then_chooses(var_dir, model_dir):
    cfg = _cfg(model_dir)
    started = _start(cfg)
    outcome = _gate(cfg, started)
    stored = _stored(cfg)
    assert sorted(stored) == ["bfloat16", "int8"] and all(r.sequences == 6 for r in stored.values())
    # auto chose among all three, each measured on this host (host-dependent: which one wins)
    choice = outcome.verdict.choice
    assert choice in ("float32", "bfloat16", "int8") and "no gate result" not in outcome.verdict.reason
    assert all(measured(outcome.verdict.reason, f) for f in ("bfloat16", "int8"))
    if choice == "float32":
        assert outcome.switch is None
    else:
        assert outcome.switch.active == f"auto-{choice}" and outcome.switch.previous == "primary"


def test_a_second_start_reads_the_stored_results_and_gates_nothing(var_dir, model_dir, gate_runs):
    cfg = _cfg(model_dir)
    _gate(cfg, _start(cfg))
    second = _start(cfg)
    assert second.candidates == {} and not second.warm  # the results are part of the warm-start key
    assert "no gate result" not in second.record.reason and selection.GATING not in second.record.reason
    third = _start(cfg)
    assert third.warm and third.record == second.record and third.candidates == {}
    assert gate_runs == []  # in this process: the one gate ran in the child


def test_only_candidates_without_a_stored_result_are_preloaded_for_the_gate(var_dir, model_dir):
    cfg = _cfg(model_dir, auto_candidates=("float32", "bfloat16"))
    _gate(cfg, _start(cfg))
    started = _start(_cfg(model_dir, auto_candidates=("float32", "bfloat16", "int4")))
    assert started.candidates == {"auto-int4": "int4"}
    assert selection.GATING in started.record.reason and measured(started.record.reason, "bfloat16")


def test_a_candidate_failing_the_gate_is_stored_and_not_switched_to(var_dir, model_dir):
    cfg = _cfg(model_dir, auto_candidates=("float32", "int4"), gate=STRICT)
    outcome = _gate(cfg, _start(cfg))
    assert outcome.verdict.choice == "float32" and outcome.switch is None
    assert "int4 fails the quality gate" in outcome.verdict.reason
    assert not _stored(cfg)["int4"].passes(STRICT)  # stored all the same: the next start does not gate it
    assert _start(cfg).candidates == {}


def test_without_the_reference_among_the_candidates_the_first_start_still_serves_it(var_dir, model_dir):
    cfg = _cfg(model_dir, auto_candidates=("int8",))
    started = _start(cfg)
    assert started.record.format == "float32" and started.candidates == {"auto-int8": "int8"}
    outcome = _gate(cfg, started)
    if outcome.verdict.choice is None:  # int8 not batch-invariant on this host: nothing is eligible
        assert "breaks rule 'eligible'" in outcome.verdict.reason and outcome.switch is None
    else:
        assert outcome.switch == Switch("auto-int8", "primary")


def test_gate_at_start_off_keeps_ungated_candidates_out(var_dir, model_dir, gate_runs):
    started = _start(_cfg(model_dir, gate_at_start=False))
    assert gate_runs == [] and not (var_dir / "gate").exists() and started.candidates == {}
    assert started.record.format == "float32" and "bfloat16 has no gate result" in started.record.reason


def test_an_explicit_format_is_not_gated(var_dir, model_dir, gate_runs):
    cfg = dataclasses.replace(_cfg(model_dir), engine=tiny_config(format="float32"))
    assert _start(cfg).candidates == {}


@pytest.fixture
def corrupted(tmp_path, monkeypatch):
    data = json.loads(gateprompts.PROMPTS_FILE.read_text())
    data["sequences"][3]["ids"][5] += 1
    path = tmp_path / "gate_prompts.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(gateprompts, "PROMPTS_FILE", path)
    return path


def test_the_stage_refuses_a_corrupted_or_unreadable_prompt_file_before_it_listens(var_dir, model_dir, corrupted,
                                                                                  monkeypatch, tmp_path):
    monkeypatch.setenv("KEEL_MODEL", str(model_dir))
    monkeypatch.setenv("KEEL_MODELS_DIR", str(tmp_path / "models"))
    with pytest.raises(ConfigError, match="corrupted"):
        server.build()  # shared.server.run turns this ConfigError into exit 2
    corrupted.write_text('{"sha256": "0", "sequences": [')
    with pytest.raises(ConfigError, match="unreadable"):
        server.build()
    monkeypatch.setenv("KEEL_INFERENCE_FORMATS__GATE_AT_START", "false")
    server.build()  # not needed, not read


def test_the_stored_prompts_hash_to_their_digest_and_are_the_full_set():
    prompts = gateprompts.load()
    assert len(prompts) == 200 and sum(len(s.ids) - s.score_from for s in prompts) == 2640
    assert gateprompts.load(6) == prompts[:6]
    with pytest.raises(ConfigError, match="formats.gate_prompts"):
        gateprompts.load(201)


@pytest.mark.parametrize("key,value,field", [("GATE_AT_START", "sometimes", "formats.gate_at_start"),
                                             ("GATE_PROMPTS", "0", "formats.gate_prompts"),
                                             ("GATE_PROMPTS", "many", "formats.gate_prompts")])
def test_a_bad_gate_setting_names_its_field(key, value, field):
    with pytest.raises(ConfigError, match=field):
        inf_config.load(environ={f"KEEL_INFERENCE_FORMATS__{key}": value})


def test_a_read_only_var_serves_without_gating_or_storing(var_dir, model_dir, gate_runs, caplog):
    """Where var/ cannot be written (a read-only root), a gate run would be lost at every start: the
    stage skips it, warns, chooses among the stored results (none: float32) and still serves."""
    var_dir.mkdir(parents=True)
    (var_dir / "gate").write_text("a file where the folder would go")  # mkdir fails, as on a read-only root
    (var_dir / "warm").write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING):
        started = _start(_cfg(model_dir))
    assert gate_runs == [] and started.record.format == "float32" and not started.warm and started.candidates == {}
    messages = {r.getMessage() for r in caplog.records}
    assert {"quality gate not run at start: its results could not be stored",
            "warm-start record not stored"} <= messages
