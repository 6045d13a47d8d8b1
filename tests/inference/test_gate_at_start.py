"""`auto` gates its ungated candidates at start (startgate.py), stores the results, and a later start
reads them instead of gating again; on the tiny model with a few of the stored probes."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from services.inference import server
from services.inference.startup import bootstrap, formats, gate, gateprobes, warmcache
from services.inference import config as inf_config
from services.inference.config import InferenceConfig
from services.inference.startup.formats import FormatsConfig
from services.inference.startup.gate import GateThresholds
from shared.config import ConfigError
from tests.inference.helpers import measured, tiny_config

LENIENT = GateThresholds(kl_mean_max=1e9, kl_p95_max=1e9, greedy_agreement_min=0)  # every format passes
STRICT = GateThresholds(kl_mean_max=0, kl_p95_max=0, greedy_agreement_min=1)  # only bit-equal ones pass


@pytest.fixture
def var_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    return tmp_path / "var"


@pytest.fixture
def gate_runs(monkeypatch):
    """Each call of the gate's scoring: the formats it scored and how many sequences."""
    calls, evaluate = [], gate.evaluate

    def counting(reference, candidates, sequences, progress=None):
        calls.append((sorted(candidates), len(sequences)))
        return evaluate(reference, candidates, sequences, progress)
    monkeypatch.setattr(gate, "evaluate", counting)
    return calls


def _cfg(model_dir, **fmt) -> InferenceConfig:
    values = {"auto_candidates": ("float32", "bfloat16", "int8"), "gate_prompts": 6, "gate": LENIENT, **fmt}
    return InferenceConfig(model_path=str(model_dir), engine=tiny_config(dtype="auto"), formats=FormatsConfig(**values))


def _start(cfg: InferenceConfig) -> bootstrap.Started:
    return bootstrap.start_engine(cfg, warmcache.model_sha256(cfg.model_dir))


def _stored(cfg: InferenceConfig) -> dict[str, gate.GateResult]:
    sha = warmcache.model_sha256(cfg.model_dir)
    return gate.load(formats.gate_path(sha), sha)


def test_a_first_start_without_stored_results_gates_the_candidates_and_stores_them(var_dir, model_dir, gate_runs):
    cfg = _cfg(model_dir)
    started = _start(cfg)
    assert gate_runs == [(["bfloat16", "int8"], 6)]  # float32 is the reference: never gated
    stored = _stored(cfg)
    assert sorted(stored) == ["bfloat16", "int8"] and all(r.sequences == 6 for r in stored.values())
    assert "quality_gate" in started.phases_s
    # auto chose among all three (each timed), not float32 by default
    assert "no gate result" not in started.record.reason
    assert measured(started.record.reason, "bfloat16") and measured(started.record.reason, "int8")


def test_a_second_start_reads_the_stored_results_and_does_not_gate_again(var_dir, model_dir, gate_runs):
    cfg = _cfg(model_dir)
    first = _start(cfg)
    second = _start(cfg)
    assert len(gate_runs) == 1 and "quality_gate" not in second.phases_s
    assert second.warm and second.record == first.record  # the warm record keeps the format chosen
    cold_again = _start(dataclasses.replace(cfg, warm_restart=False))  # measures again, still no gate
    assert len(gate_runs) == 1 and "no gate result" not in cold_again.record.reason


def test_only_candidates_without_a_stored_result_are_gated(var_dir, model_dir, gate_runs):
    _start(_cfg(model_dir, auto_candidates=("float32", "bfloat16")))
    _start(_cfg(model_dir, auto_candidates=("float32", "bfloat16", "int4")))
    assert gate_runs == [(["bfloat16"], 6), (["int4"], 6)]
    assert sorted(_stored(_cfg(model_dir))) == ["bfloat16", "int4"]  # the first run's result is kept


def test_a_candidate_failing_the_gate_at_start_is_not_chosen_and_why_is_logged(var_dir, model_dir, gate_runs,
                                                                                caplog):
    cfg = _cfg(model_dir, auto_candidates=("float32", "int4"), gate=STRICT)
    with caplog.at_level(logging.INFO, logger="services.inference"):
        started = _start(cfg)
    assert started.record.format == "float32"
    assert "int4 fails the quality gate" in started.record.reason
    [run] = [r for r in caplog.records if r.getMessage() == "quality gate run at start"]
    assert run.verdicts["int4"].startswith("fails: mean KL")
    assert not _stored(cfg)["int4"].passes(STRICT)  # stored all the same: the next start does not gate it
    _start(cfg)
    assert len(gate_runs) == 1


def test_gate_at_start_off_keeps_ungated_candidates_out(var_dir, model_dir, gate_runs):
    started = _start(_cfg(model_dir, gate_at_start=False))
    assert gate_runs == [] and not (var_dir / "gate").exists()
    assert started.record.format == "float32" and "bfloat16 has no gate result" in started.record.reason


def test_an_explicit_format_is_not_gated_at_start(var_dir, model_dir, gate_runs):
    cfg = dataclasses.replace(_cfg(model_dir), engine=tiny_config(dtype="float32"))
    _start(cfg)
    assert gate_runs == []


@pytest.fixture
def corrupted(tmp_path, monkeypatch):
    data = json.loads(gateprobes.PROBES_FILE.read_text())
    data["sequences"][3]["ids"][5] += 1
    path = tmp_path / "gate_probes.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(gateprobes, "PROBES_FILE", path)
    return path


def test_a_corrupted_probe_file_stops_the_start_before_anything_is_gated(var_dir, model_dir, gate_runs, corrupted):
    with pytest.raises(ConfigError, match="formats.gate_at_start.*corrupted.*sha256") as err:
        _start(_cfg(model_dir))
    assert str(corrupted) in str(err.value) and gate_runs == [] and not (var_dir / "gate").exists()


def test_the_stage_refuses_a_corrupted_or_unreadable_probe_file_before_it_listens(var_dir, model_dir, corrupted,
                                                                                  monkeypatch):
    monkeypatch.setenv("KEEL_INFERENCE_MODEL_PATH", str(model_dir))
    with pytest.raises(ConfigError, match="corrupted"):
        server.build()  # shared.server.run turns this ConfigError into exit 2
    corrupted.write_text('{"sha256": "0", "sequences": [')
    with pytest.raises(ConfigError, match="unreadable"):
        server.build()
    monkeypatch.setenv("KEEL_INFERENCE_FORMATS__GATE_AT_START", "false")
    server.build()  # not needed, not read


def test_the_stored_probes_hash_to_their_digest_and_are_the_full_set():
    probes = gateprobes.load()
    assert len(probes) == 200 and sum(len(s.ids) - s.score_from for s in probes) == 2640
    assert gateprobes.load(6) == probes[:6]
    with pytest.raises(ConfigError, match="formats.gate_prompts"):
        gateprobes.load(201)


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
    assert gate_runs == [] and started.record.format == "float32" and not started.warm
    messages = {r.getMessage() for r in caplog.records}
    assert {"quality gate not run at start: its results could not be stored",
            "warm-start record not stored"} <= messages
