"""The LoRA start-up record (lora/startcache.py): reused on a second start after one verified check row,
measured again when an adapter file, the base or the record itself changed, and never a refusal turned
into an acceptance. Check work is counted as rows passed to the runner's forward (a wrapper, here)."""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import replace

import pytest
import torch

from services.inference.lora import manifest
from services.inference.lora.registration import register
from services.inference.lora.registry import LoraConfig, load_registry
from services.inference.lora.startcache import StartCache
from testing.lora import base_of, make_adapter
from testing.tiny import tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tiny):
    return base_of(tiny)


@pytest.fixture(scope="module")
def other():
    """Other weights under the same fingerprint fields: only the check run can tell (GOLDEN_MISMATCH)."""
    return base_of(tiny_model(seed=1))


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_VAR_DIR", str(tmp_path / "var"))
    return LoraConfig(registry_dir=str(tmp_path / "registry"))


def count_rows(runner, monkeypatch) -> list[int]:
    """A one-element list counting the rows (segments) of every forward pass of `runner`."""
    counted = [0]
    forward = runner.forward

    def counting(segments):
        counted[0] += len(segments)
        return forward(segments)

    monkeypatch.setattr(runner, "forward", counting)
    return counted


def start(cfg, base, engine_key="engine-a"):
    cache = StartCache(engine_key, base)
    return {s.name: s for s in load_registry(cfg, base, cache).states}, cache.outcome


def record(tmp_path):
    (path,) = (tmp_path / "var" / "warm").glob("lora-*.json")
    return path


def rewrite(path, edit) -> None:
    """Edit a record's body and recompute its checksum, as a forger would."""
    data = json.loads(path.read_text())
    edit(data["body"])
    data["checksum"] = hashlib.sha256(json.dumps(data["body"], sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(data))


def test_a_second_start_reuses_the_record_after_one_check_row_per_adapter(tiny, base, cfg, tmp_path, monkeypatch):
    register(make_adapter(tiny, tmp_path / "a", seed=1), "a", "1", base, cfg)
    register(make_adapter(tiny, tmp_path / "b", seed=2, rank=8, targets=("o_proj", "down_proj")), "b", "1", base, cfg)
    prompts, steps = len(base.check_prompts.prompts), base.check_prompts.continuation_tokens
    rows = count_rows(base.runner, monkeypatch)
    cold, outcome = start(cfg, base)
    assert (outcome["base"], outcome["adapters"]) == ("measured", {"a@1": "measured", "b@1": "measured"})
    assert rows[0] == 3 * prompts * steps
    rows[0] = 0
    warm, outcome = start(cfg, base)
    assert (outcome["base"], outcome["adapters"]) == ("reused", {"a@1": "reused", "b@1": "reused"})
    assert rows[0] == 3 * steps  # one check row of the base and of each adapter
    assert warm == cold and warm["a@1"].state == warm["b@1"].state == "accepted"
    assert base.runner.lora.count == 3
    rows[0] = 0
    _, outcome = start(cfg, base, engine_key="engine-b")  # another engine: its own record, measured
    assert outcome["base"] == "measured" and rows[0] == 3 * prompts * steps
    assert len(list((tmp_path / "var" / "warm").glob("lora-*.json"))) == 2


def _swap_weights(cfg) -> None:
    """b@1 gets a@1's weights with its record's hashes updated (as an in-place re-registration would
    leave it): every static check passes, only the check run can tell."""
    folder = cfg.root / "b" / "1"
    shutil.copyfile(cfg.root / "a" / "1" / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    data = json.loads((folder / manifest.MANIFEST).read_text())
    data["files_sha256"]["adapter_model.safetensors"] = manifest.file_sha256(folder / "adapter_model.safetensors")
    (folder / manifest.MANIFEST).write_text(json.dumps(data))


def _touch_record(cfg) -> None:
    path = cfg.root / "b" / "1" / manifest.MANIFEST
    path.write_text(path.read_text().replace('"created_at": "', '"created_at": "1'))


@pytest.mark.parametrize("change, state", [(_swap_weights, "refused"), (_touch_record, "accepted")])
def test_a_changed_adapter_file_measures_that_adapter_again(tiny, base, cfg, tmp_path, monkeypatch, change, state):
    register(make_adapter(tiny, tmp_path / "a", seed=3), "a", "1", base, cfg)
    register(make_adapter(tiny, tmp_path / "b", seed=4), "b", "1", base, cfg)
    start(cfg, base)
    change(cfg)
    rows = count_rows(base.runner, monkeypatch)
    states, outcome = start(cfg, base)
    assert outcome["adapters"] == {"a@1": "reused", "b@1": "measured"}
    prompts, steps = len(base.check_prompts.prompts), base.check_prompts.continuation_tokens
    assert rows[0] == 2 * steps + prompts * steps  # verification of the base and a@1, then b@1 in full
    assert states["b@1"].state == state
    if state == "refused":
        assert states["b@1"].reason == "GOLDEN_MISMATCH"
    _, outcome = start(cfg, base)  # the rewritten record serves the changed adapter next time
    assert outcome["adapters"] == {"a@1": "reused", "b@1": "reused"}


def test_a_refused_adapter_stays_refused_for_the_same_reason_from_the_record(tiny, base, other, cfg, tmp_path,
                                                                             monkeypatch):
    register(make_adapter(tiny, tmp_path / "a", seed=5), "a", "1", base, cfg)
    cold, _ = start(cfg, other)
    rows = count_rows(other.runner, monkeypatch)
    warm, outcome = start(cfg, other)
    assert outcome["adapters"] == {"a@1": "reused"} and rows[0] == 2 * other.check_prompts.continuation_tokens
    assert cold["a@1"].reason == "GOLDEN_MISMATCH" and warm == cold


def test_the_verdict_is_derived_again_from_the_record_with_the_current_settings(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=6), "a", "1", base, cfg)
    nudged_model = copy.deepcopy(tiny)
    with torch.no_grad():
        w = nudged_model.model.layers[1].mlp.down_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 1e-4)
    nudged = base_of(nudged_model)  # same greedy outputs, slightly different distributions
    strict = replace(cfg, drift_threshold=1e-12)
    cold, _ = start(strict, nudged)
    assert cold["a@1"].reason == "ADAPTER_DRIFT"
    warm, outcome = start(strict, nudged)
    assert outcome["adapters"] == {"a@1": "reused"} and warm == cold
    warned, outcome = start(replace(strict, drift_action="warn"), nudged)
    assert outcome["adapters"] == {"a@1": "reused"} and warned["a@1"].state == "accepted"
    assert warned["a@1"].drift["p95"] == float(cold["a@1"].metadata["p95"]) > 0


def test_a_forged_entry_fails_the_verification_and_the_refusal_stands(tiny, base, other, cfg, tmp_path,
                                                                        monkeypatch):
    register(make_adapter(tiny, tmp_path / "a", seed=7), "a", "1", base, cfg)
    cold, _ = start(cfg, other)
    golden = manifest.read(cfg.root / "a" / "1").golden_ids

    def accept(body):  # every row's greedy ids made equal to the golden ones: the cached facts now say "accept"
        for row, ids in zip(body["adapters"]["a@1"]["rows"], golden):
            row["greedy"] = list(ids)

    rewrite(record(tmp_path), accept)
    rows = count_rows(other.runner, monkeypatch)
    warm, outcome = start(cfg, other)
    assert outcome["adapters"] == {"a@1": "verification failed, measured"}
    prompts, steps = len(other.check_prompts.prompts), other.check_prompts.continuation_tokens
    assert rows[0] == 2 * steps + prompts * steps
    assert warm == cold and warm["a@1"].reason == "GOLDEN_MISMATCH"
    _, outcome = start(cfg, other)  # the record was rewritten with the true measurement
    assert outcome["adapters"] == {"a@1": "reused"}


def test_a_forged_base_entry_drops_the_whole_record(tiny, base, cfg, tmp_path, monkeypatch):
    register(make_adapter(tiny, tmp_path / "a", seed=8), "a", "1", base, cfg)
    cold, _ = start(cfg, base)

    def forge(body):
        for row in body["base"]:
            row["digest"] = "0" * 64

    rewrite(record(tmp_path), forge)
    rows = count_rows(base.runner, monkeypatch)
    warm, outcome = start(cfg, base)
    assert (outcome["base"], outcome["adapters"]) == ("verification failed, measured", {"a@1": "measured"})
    prompts, steps = len(base.check_prompts.prompts), base.check_prompts.continuation_tokens
    assert rows[0] == 2 * steps + 2 * prompts * steps and warm == cold


def test_a_corrupted_record_is_not_read(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=9), "a", "1", base, cfg)
    cold, _ = start(cfg, base)
    path = record(tmp_path)
    data = json.loads(path.read_text())
    data["body"]["adapters"]["a@1"]["rows"][0]["kl"][0] += 1.0  # no checksum update: bit rot, a bad copy
    path.write_text(json.dumps(data))
    warm, outcome = start(cfg, base)
    assert (outcome["base"], outcome["adapters"]) == ("record unusable, measured", {"a@1": "measured"})
    assert warm == cold


def test_a_malformed_entry_is_measured_again_not_a_failed_start(tiny, base, cfg, tmp_path):
    register(make_adapter(tiny, tmp_path / "a", seed=10), "a", "1", base, cfg)
    cold, _ = start(cfg, base)

    def drop_kl(body):
        for row in body["adapters"]["a@1"]["rows"]:
            del row["kl"]

    rewrite(record(tmp_path), drop_kl)
    warm, outcome = start(cfg, base)
    assert (outcome["base"], outcome["adapters"]) == ("reused", {"a@1": "measured"}) and warm == cold
