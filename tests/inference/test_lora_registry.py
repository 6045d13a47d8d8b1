"""Registration and the start-up checks of LoRA adapters: every refusal path, on real PEFT folders."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from services.inference.lora import manifest
from services.inference.lora.registration import register
from services.inference.lora.registry import LoraConfig, load_registry
from shared.errors import InvalidInput, NotFound, PreconditionFailed
from testing.lora import base_of, make_adapter
from testing.tiny import tiny_model


@pytest.fixture(scope="module")
def base(tiny):
    return base_of(tiny)


@pytest.fixture
def cfg(tmp_path):
    return LoraConfig(registry_dir=str(tmp_path / "registry"))


def _refusal(exc_info) -> tuple[str, dict]:
    return exc_info.value.reason, exc_info.value.metadata


def test_register_writes_the_record_the_card_and_golden_outputs(tiny, base, cfg, tmp_path):
    src = make_adapter(tiny, tmp_path / "src", seed=1)
    data_manifest = tmp_path / "data.json"
    data_manifest.write_text('{"rows": 10}')
    m = register(src, "french", "1", base, cfg, data_manifest)
    folder = cfg.root / "french" / "1"
    assert manifest.read(folder) == m
    assert m.base_fingerprint == base.digest and m.base["rope_theta"] == "100000.0"
    assert m.training_data_version == manifest.file_sha256(data_manifest)
    assert (m.rank, m.alpha, m.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert len(m.golden_ids) == len(base.check_prompts.prompts)
    assert all(len(g) == base.check_prompts.continuation_tokens for g in m.golden_ids)
    assert m.kl_vs_base["mean"] > 0 and m.kl_vs_base["direction"] == "KL(adapter || base)"
    assert m.drift_gate == {"direction": "KL(registered || now)", "aggregation": "mean and p95 over check positions",
                            "top_k": 64, "threshold": 0.3}
    card = (folder / manifest.CARD).read_text()
    assert "french@1" in card and m.base_fingerprint in card
    with pytest.raises(PreconditionFailed) as exc:
        register(src, "french", "1", base, cfg)
    assert exc.value.reason == "ADAPTER_EXISTS"


def test_a_version_1_record_is_read_with_its_old_key(tiny, base, cfg, tmp_path):
    m = register(make_adapter(tiny, tmp_path / "src", seed=1), "french", "1", base, cfg)
    path = cfg.root / "french" / "1" / manifest.MANIFEST
    old = json.loads(path.read_text())
    old["probe_set_sha256"], old["record_version"] = old.pop("check_prompts_sha256"), 1
    path.write_text(json.dumps(old))
    assert manifest.read(path.parent) == m


@pytest.mark.parametrize("override, key", [
    ({"brand_new_option": 1}, "brand_new_option"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 128, "lora_alpha": 16}, "r"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
])
def test_config_this_build_does_not_understand_is_refused_by_key(tiny, base, cfg, tmp_path, override, key):
    src = make_adapter(tiny, tmp_path / "src", seed=2, config_overrides=override)
    with pytest.raises(PreconditionFailed) as exc:
        register(src, "x", "1", base, cfg)
    assert _refusal(exc) == ("UNSUPPORTED_ADAPTER_CONFIG", {"key": key})
    assert not (cfg.root / "x").exists() or not list((cfg.root / "x").iterdir())


def test_inert_adapters_are_refused(tiny, base, cfg, tmp_path):
    nothing = make_adapter(tiny, tmp_path / "a", seed=3, config_overrides={"target_modules": ["c_attn"]})
    with pytest.raises(PreconditionFailed) as exc:
        register(nothing, "x", "1", base, cfg)
    assert _refusal(exc) == ("INERT_ADAPTER", {"target": "c_attn"})
    missing = make_adapter(tiny, tmp_path / "b", seed=3,
                           config_overrides={"target_modules": ["q_proj", "v_proj", "k_proj"]})
    with pytest.raises(PreconditionFailed) as exc:
        register(missing, "x", "1", base, cfg)
    assert exc.value.reason == "INERT_ADAPTER" and "k_proj" in exc.value.metadata["module"]


def test_an_adapter_that_changes_nothing_is_refused(tiny, base, cfg, tmp_path):
    src = make_adapter(tiny, tmp_path / "zero", seed=4, b_std=0.0)  # PEFT's own initialisation: B = 0
    with pytest.raises(PreconditionFailed) as exc:
        register(src, "noop", "1", base, cfg)
    assert exc.value.reason == "ADAPTER_CHANGES_NOTHING"


def test_start_accepts_good_adapters_and_refuses_the_rest_without_stopping(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=5), "good", "1", base, cfg)
    register(make_adapter(tiny, tmp_path / "b", seed=6, rank=8, targets=("o_proj", "down_proj")), "good", "2", base,
             cfg)
    register(make_adapter(tiny, tmp_path / "c", seed=7), "other", "1", base_of(tiny, "another-base"), cfg)
    table = load_registry(cfg, base)
    states = {s.name: s for s in table.states}
    assert states["good@1"].state == states["good@2"].state == "accepted"
    assert {states["good@1"].slot, states["good@2"].slot} == {1, 2}
    other = states["other@1"]
    assert (other.state, other.reason, other.metadata) == ("refused", "BASE_FINGERPRINT_MISMATCH",
                                                         {"fields": "weights_sha256"})
    assert states["good@1"].drift["mean"] == 0.0
    assert table.slots.count == 3 and base.runner.lora is table.slots
    assert table.resolve("") == (0, "")
    assert table.resolve("good") == (states["good@2"].slot, "good@2")  # the newest accepted version
    assert table.resolve("good@1") == (states["good@1"].slot, "good@1")
    with pytest.raises(NotFound) as exc:
        table.resolve("nobody")
    assert exc.value.reason == "ADAPTER_NOT_FOUND"
    with pytest.raises(NotFound):
        table.resolve("good@9")
    with pytest.raises(PreconditionFailed) as exc:
        table.resolve("other")
    assert _refusal(exc) == ("ADAPTER_REFUSED", {"adapter": "other@1", "refusal_reason": "BASE_FINGERPRINT_MISMATCH"})
    assert json.loads((cfg.root / "base.json").read_text())["fingerprint"] == base.digest


def test_changed_files_and_a_lower_max_rank_are_refused_at_start(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=8), "edited", "1", base, cfg)
    register(make_adapter(tiny, tmp_path / "b", seed=9, rank=8), "big", "1", base, cfg)
    cfg_path = cfg.root / "edited" / "1" / "adapter_config.json"
    cfg_path.write_text(cfg_path.read_text().replace('"r": 4', '"r": 4 '))
    states = {s.name: s for s in load_registry(replace(cfg, max_rank=4), base).states}
    assert states["edited@1"].reason == "ADAPTER_RECORD_INVALID"
    assert (states["big@1"].reason, states["big@1"].metadata) == ("UNSUPPORTED_ADAPTER_CONFIG", {"key": "r"})


def test_outputs_that_differ_from_the_golden_ones_are_refused(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=10), "a", "1", base, cfg)
    other = tiny_model(seed=1)  # other weights under the same fingerprint: only the check run can tell
    state = load_registry(cfg, base_of(other)).states[0]
    assert state.reason == "GOLDEN_MISMATCH" and state.metadata["prompt"] == "0"


def test_in_another_format_the_drift_gate_judges_instead_of_greedy_equality(tiny, base, cfg, tmp_path):
    # Registered in float32; served in bfloat16 by a base with the same bound fields (the weights hash)
    # whose outputs differ: exact greedy equality would refuse it, the drift gate decides instead.
    register(make_adapter(tiny, tmp_path / "a", seed=10), "a", "1", base, cfg)
    served = base_of(tiny_model(seed=1), fmt="bfloat16")
    assert served.digest == base.digest  # the format is recorded, not bound
    refused = load_registry(replace(cfg, drift_threshold=1e-12), served).states[0]
    assert refused.reason == "ADAPTER_DRIFT"
    accepted = load_registry(replace(cfg, drift_threshold=1e9), served).states[0]
    assert accepted.state == "accepted" and accepted.drift["mean"] > 0
    same_format = load_registry(replace(cfg, drift_threshold=1e9), base_of(tiny_model(seed=1))).states[0]
    assert same_format.reason == "GOLDEN_MISMATCH"


def _nudged(model, scale):
    out = copy.deepcopy(model)
    with torch.no_grad():
        w = out.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * scale)
    return out


@pytest.mark.slow
def test_drift_above_the_threshold_refuses_or_warns(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=11), "a", "1", base, cfg)
    nudged = base_of(_nudged(tiny, 1e-4))  # same greedy outputs, slightly different distributions
    state = load_registry(replace(cfg, drift_threshold=1e-12), nudged).states[0]
    assert state.reason == "ADAPTER_DRIFT" and float(state.metadata["p95"]) > 1e-12
    warned = load_registry(replace(cfg, drift_threshold=1e-12, drift_action="warn"), nudged).states[0]
    assert warned.state == "accepted" and warned.drift["p95"] > 0
    assert load_registry(cfg, nudged).states[0].state == "accepted"  # the default threshold 0.3


def test_names_are_checked(tiny, base, cfg, tmp_path):
    with pytest.raises(InvalidInput) as exc:
        register(tmp_path, "../evil", "1", base, cfg)
    assert exc.value.reason == "INVALID_ADAPTER_NAME"
