"""The quality gate (teacher-forced KL, greedy agreement), its refusals, and the `auto` choice, on the tiny model."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.inference.formats import quality, selection
from services.inference.formats.quality import GateResult, GateThresholds, Sequence
from services.inference.formats.selection import FormatsConfig
from services.inference.model.loader import convert_model
from shared.config import ROOT_DIR, ConfigError
from testing.tiny import save_model
from tests.inference.helpers import prompt

SHA = "0" * 64


def _sequences(n: int = 6) -> list[Sequence]:
    return [Sequence(tuple(prompt(s, 14)), 6) for s in range(n)]


def test_float32_against_itself_has_zero_kl_and_full_agreement(tiny):
    [r] = quality.evaluate(tiny, {"float32": tiny}, _sequences())
    assert r.kl_mean == 0 and r.kl_p95 == 0 and r.greedy_agreement == 1
    assert r.positions == 6 * 8 and r.sequences == 6  # positions 6..13 of each 14-token sequence
    assert r.passes(GateThresholds())


def test_kl_is_the_mean_over_scored_positions_of_kl_reference_to_candidate(tiny):
    seq = _sequences(1)[0]
    cand = convert_model(tiny, "int4")
    [r] = quality.evaluate(tiny, {"int4": cand}, [seq])
    with torch.inference_mode():
        ids = torch.tensor([seq.ids[:-1]])
        p = torch.log_softmax(tiny(ids).logits[0, 5:].double(), -1)
        q = torch.log_softmax(cand(ids).logits[0, 5:].double(), -1)
    expected = (p.exp() * (p - q)).sum(-1)
    assert math.isclose(r.kl_mean, float(expected.mean()), rel_tol=1e-3)
    assert r.greedy_agreement == float((p.argmax(-1) == q.argmax(-1)).double().mean())


def test_a_degraded_format_fails_with_every_broken_threshold_named(tiny):
    [r] = quality.evaluate(tiny, {"int4": convert_model(tiny, "int4")}, _sequences())
    strict = GateThresholds(kl_mean_max=1e-6, kl_p95_max=1e-6, greedy_agreement_min=1.0)
    failures = r.failures(strict)
    assert len(failures) >= 2 and any("mean KL" in f for f in failures) and any("p95 KL" in f for f in failures)
    assert not r.passes(strict)
    assert r.passes(GateThresholds(kl_mean_max=1e9, kl_p95_max=1e9, greedy_agreement_min=0))


def test_non_finite_kl_fails(tiny):
    broken = convert_model(tiny, "bfloat16")
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    [r] = quality.evaluate(tiny, {"bfloat16": broken}, _sequences(2))
    assert math.isinf(r.kl_mean) and not r.passes(GateThresholds(kl_mean_max=1e9, kl_p95_max=1e9))


def _store(results: dict[str, tuple[float, float, float]]) -> None:
    quality.store(selection.gate_path(SHA), SHA, [GateResult(f, *v, 100, 10) for f, v in results.items()], "test")


def test_stored_results_round_trip_and_belong_to_one_model(var_dir):
    _store({"int8": (0.01, 0.05, 0.97)})
    assert quality.load(selection.gate_path(SHA), SHA)["int8"].greedy_agreement == 0.97
    assert quality.load(selection.gate_path(SHA), "1" * 64) == {}


@pytest.mark.parametrize("stored,needle", [({}, "no gate result"), ({"int4": (0.5, 2.0, 0.6)}, "fails the quality "
                                                                                               "gate")])
def test_an_explicit_format_without_a_pass_is_refused(var_dir, stored, needle):
    _store(stored)
    with pytest.raises(ConfigError, match=needle) as err:
        selection.check_explicit("int4", SHA, FormatsConfig())
    assert "engine.format" in str(err.value) and "formats.force" in str(err.value)


def test_force_serves_a_failing_format_and_says_so(var_dir):
    _store({"int4": (0.5, 2.0, 0.6)})
    choice = selection.check_explicit("int4", SHA, FormatsConfig(force=True))
    assert choice.format == "int4" and choice.reason.startswith("forced:") and choice.gate.kl_mean == 0.5


def test_passing_and_reference_formats_are_served(var_dir):
    _store({"int8": (0.01, 0.05, 0.97)})
    assert selection.check_explicit("int8", SHA, FormatsConfig()).reason.startswith("configured: int8 passes")
    assert selection.check_explicit("float32", SHA, FormatsConfig()).gate is None


def test_auto_never_picks_a_format_that_fails_or_was_not_gated(var_dir, tiny):
    _store({"int8": (0.01, 0.05, 0.97), "int4": (0.5, 2.0, 0.6)})  # bfloat16: never gated
    cfg = FormatsConfig(auto_candidates=("float32", "bfloat16", "int8", "int4"))
    choice, model = selection.choose_auto(tiny, SHA, cfg, max_batch=4, device="cpu", model_dir=Path("unused"))
    assert choice.format in ("float32", "int8") and model.format == choice.format
    assert "int4 fails the quality gate" in choice.reason and "bfloat16 has no gate result" in choice.reason
    assert "decode pass" in choice.reason  # the eligible ones were timed


def test_auto_refuses_a_passing_format_whose_step_is_not_batch_invariant_on_this_host(var_dir, tiny, monkeypatch):
    # aten's bfloat16 GEMM is batch-invariant on some CPUs and not on others: auto measures it.
    _store({"bfloat16": (0.01, 0.05, 0.97), "int8": (0.01, 0.05, 0.97)})
    real = selection.step_invariant
    monkeypatch.setattr(selection, "step_invariant", lambda model, device: model.format != "bfloat16"
                        and real(model, device))
    cfg = FormatsConfig(auto_candidates=("float32", "bfloat16", "int8"))
    choice, model = selection.choose_auto(tiny, SHA, cfg, max_batch=4, device="cpu", model_dir=Path("unused"))
    assert choice.format != "bfloat16" and model.format == choice.format
    assert "bfloat16: a decode step gives a row other bits beside other rows than alone" in choice.reason


def test_auto_with_only_quantized_candidates_that_pass_serves_one_of_them(var_dir, tiny):
    _store({"int8": (0.01, 0.05, 0.97), "int4": (0.01, 0.05, 0.97)})
    cfg = FormatsConfig(auto_candidates=("int8", "int4"))
    choice, model = selection.choose_auto(tiny, SHA, cfg, max_batch=4, device="cpu", model_dir=Path("unused"))
    assert choice.format in ("int8", "int4") and choice.gate.format == choice.format


def test_auto_serves_a_sole_gated_candidate_without_timing_it(var_dir, tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("timed a format with nothing to compare it with")
    monkeypatch.setattr(selection, "decode_pass_s", refuse)
    # no gate results
    choice, model = selection.choose_auto(tiny, SHA, FormatsConfig(), max_batch=4, device="cpu",
                                          model_dir=Path("unused"))
    assert choice.format == "float32" and model is tiny
    assert choice.reason.startswith("auto: float32 is the only eligible format")
    assert "int8 has no gate result" in choice.reason


def test_auto_with_no_eligible_candidate_stops_the_stage(var_dir, tiny):
    with pytest.raises(ConfigError, match="auto_candidates"):
        selection.choose_auto(tiny, SHA, FormatsConfig(auto_candidates=("int4",)), max_batch=4, device="cpu",
                              model_dir=Path("unused"))


@pytest.mark.slow
def test_weight_only_formats_are_row_invariant_and_float32_needs_padding_or_not(tiny):
    for fmt in ("bfloat16", "int8", "int4"):
        assert selection.invariant_sizes(convert_model(tiny, fmt)) == tuple(range(1, 18)), fmt
    assert 17 in selection.invariant_sizes(tiny)


@pytest.mark.slow
def test_the_stage_refuses_an_ungated_format_at_start_with_exit_2(var_dir, tmp_path, tiny):
    model_dir = tmp_path / "model"
    save_model(tiny, model_dir)
    env = {**os.environ, "KEEL_INFERENCE_ENGINE__FORMAT": "int4", "KEEL_MODEL": str(model_dir),
           "KEEL_MODELS_DIR": str(tmp_path / "models"),
           "KEEL_INFERENCE_SERVER__PORT": "0", "KEEL_INFERENCE_SERVER__METRICS_PORT": "0"}
    proc = subprocess.run([sys.executable, "-m", "services.inference"], cwd=ROOT_DIR, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "quality gate" in proc.stderr + proc.stdout and "int4 has no gate result" in proc.stderr + proc.stdout


class _BatchDependentNorm(torch.nn.Module):
    """The final norm shifted by the batch size: each linear stays row-invariant, whole steps do not."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm
        self.weight = norm.weight  # the residual stream's dtype is read off the final norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + 1e-2 * (x.shape[0] > 1)


def test_weight_only_decode_steps_are_batch_invariant_on_the_tiny_model(tiny):
    assert selection.step_invariant(convert_model(tiny, "int8"), "cpu")


@pytest.mark.slow
def test_auto_skips_a_format_whose_decode_steps_depend_on_the_batch(var_dir, tiny, monkeypatch):
    _store({"int8": (0.01, 0.05, 0.97)})
    real = selection.model_in_format

    def convert(reference, fmt, model_dir, device):
        model = real(reference, fmt, model_dir, device)
        if fmt == "int8":
            model.model.norm = _BatchDependentNorm(model.model.norm)
        return model
    monkeypatch.setattr(selection, "model_in_format", convert)
    cfg = FormatsConfig(auto_candidates=("float32", "int8"))
    choice, model = selection.choose_auto(tiny, SHA, cfg, max_batch=4, device="cpu", model_dir=Path("unused"))
    assert choice.format == "float32" and model is tiny
    assert "int8: a decode step gives a row other bits" in choice.reason
