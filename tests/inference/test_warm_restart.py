"""Warm restart: a second start of the same engine reuses the stored calibration after one probe."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from services.inference import bootstrap
from services.inference.config import InferenceConfig
from services.inference.engine import core as engine_module
from services.inference.formats import quality, selection
from services.inference.formats.selection import FormatsConfig
from services.inference.model.digest import model_sha256
from testing.tiny import save_model, tiny_model
from tests.inference.helpers import measured, tiny_config


def _cfg(model_dir, **engine) -> InferenceConfig:
    return InferenceConfig(model_path=str(model_dir), engine=tiny_config(**{"format": "float32", **engine}),
                           # no gate at start: these tests are about the record, not the gate (test_gate_at_start.py)
                           formats=FormatsConfig(auto_candidates=("float32", "bfloat16"), gate_at_start=False))


def _start(cfg: InferenceConfig) -> bootstrap.Started:
    return bootstrap.start_engine(cfg, model_sha256(cfg.model_dir))


def _no_measuring(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured again on a warm start")
    monkeypatch.setattr(engine_module, "measure_memory", refuse)


def test_second_start_reuses_the_calibration_without_measuring(var_dir, model_dir, monkeypatch):
    cfg = _cfg(model_dir)
    cold = _start(cfg)
    assert not cold.warm and "warmup_measured" in cold.phases_s
    _no_measuring(monkeypatch)
    warm = _start(cfg)
    assert warm.warm and "warmup_measured" not in warm.phases_s and "verify_probe" in warm.phases_s
    assert warm.record == cold.record
    assert warm.engine.calibration == cold.engine.calibration
    assert warm.engine.memory == cold.engine.memory


@pytest.mark.parametrize("change", [{"max_batch_size": 8}, {"intra_op_threads": 1}, {"batch_invariant": False}])
def test_a_changed_fingerprint_measures_again(var_dir, model_dir, change):
    _start(_cfg(model_dir))
    assert not _start(_cfg(model_dir, **change)).warm


def test_changed_weights_measure_again(var_dir, model_dir, tmp_path, tiny):
    _start(_cfg(model_dir))
    other = tmp_path / "other"
    save_model(tiny_model(seed=1), other)  # same shapes, other random weights
    assert not _start(_cfg(other)).warm


def test_a_failed_verification_probe_measures_again_and_rewrites_the_record(var_dir, model_dir):
    cfg = _cfg(model_dir)
    _start(cfg)
    [path] = (var_dir / "warm").glob("engine-*.json")
    data = json.loads(path.read_text())
    data["record"]["probe_digest"] = "0" * 64  # as if the kernels now gave other bits
    path.write_text(json.dumps(data))
    again = _start(cfg)
    assert not again.warm
    assert json.loads(path.read_text())["record"]["probe_digest"] == again.record.probe_digest != "0" * 64
    assert _start(cfg).warm


def test_an_unreadable_record_measures_again(var_dir, model_dir):
    cfg = _cfg(model_dir)
    _start(cfg)
    [path] = (var_dir / "warm").glob("engine-*.json")
    path.write_text("{not json")
    assert not _start(cfg).warm


def test_warm_restart_off_never_reads_or_writes_records(var_dir, model_dir):
    cfg = dataclasses.replace(_cfg(model_dir), warm_restart=False)
    _start(cfg)
    assert not list((var_dir / "warm").glob("engine-*.json"))
    assert not _start(cfg).warm


def test_auto_stores_its_choice_and_a_warm_start_loads_that_format(var_dir, model_dir, monkeypatch):
    cfg = _cfg(model_dir, format="auto")
    cold = _start(cfg)
    assert cold.record.format == "float32"  # bfloat16 has no stored gate result here
    assert "bfloat16 has no gate result" in cold.record.reason and "choose_format" in cold.phases_s
    _no_measuring(monkeypatch)
    warm = _start(cfg)
    assert warm.warm and warm.record.format == "float32" and "choose_format" not in warm.phases_s


def test_model_hash_is_cached_by_size_and_mtime(var_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    f = d / "model.safetensors"
    f.write_bytes(b"a" * 1000)
    first = model_sha256(d)
    st = f.stat()
    f.write_bytes(b"b" * 1000)  # same size; restore the mtime: the cached hash is used
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model_sha256(d) == first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new mtime: hashed again
    assert model_sha256(d) != first


def test_new_gate_results_measure_again(var_dir, model_dir):
    cfg = _cfg(model_dir, format="auto")
    _start(cfg)
    sha = model_sha256(cfg.model_dir)
    quality.store(selection.gate_path(sha), sha, [quality.GateResult("bfloat16", 0.0, 0.0, 1.0, 10, 2)], "test")
    again = _start(cfg)
    assert not again.warm and "bfloat16 has no gate result" not in again.record.reason
    assert measured(again.record.reason, "bfloat16")  # now eligible, so measured
