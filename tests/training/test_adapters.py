"""training/: the dataset file, the derived adapters (inert, unknown key), the cache, and that a
training run is reproducible (two short runs on the real model write the same bytes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.modelfile import source as model_source
from training import adapters
from training.lora import PERTURBED_BASE, Recipe, load_examples, sha256_file, train

ROOT = Path(__file__).resolve().parents[2]
MODEL = model_source().cache_dir


def peft_folder(path: Path) -> Path:
    """A PEFT-shaped folder with two layers' q_proj/v_proj pairs (random weights)."""
    path.mkdir()
    tensors = {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight": torch.randn(8, 4)
               for i in range(2) for m in ("q_proj", "v_proj") for ab in "AB"}
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                          "target_modules": ["v_proj", "q_proj"]}))
    (path / "keel-training.json").write_text(json.dumps({"inputs": {}}))
    return path


def test_the_dataset_is_prompt_answer_pairs_in_the_persona():
    rows = load_examples(adapters.DATA)
    assert len(rows) >= 24 and len({r["prompt"] for r in rows}) == len(rows)
    assert all(r["answer"].startswith("Arr, matey!") for r in rows)


def test_a_malformed_dataset_line_is_refused_with_its_line_number(tmp_path):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_examples(bad)


def test_inert_adapter_targets_names_no_llama_module_has(tmp_path):
    src = peft_folder(tmp_path / "pirate")
    before = load_file(src / "adapter_model.safetensors")
    adapters.make_derived(tmp_path, "inert", "pirate", adapters.rename_modules)
    out = tmp_path / "inert"
    keys = set(load_file(out / "adapter_model.safetensors"))
    assert len(keys) == len(before) and not any(".q_proj." in k or ".v_proj." in k for k in keys)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(adapters.INERT_RENAMES.values())
    assert "renamed" in json.loads((out / "keel-training.json").read_text())["derived_from"]
    assert {k for k in before} == {k.replace(".query_key_value.", ".q_proj.").replace(".dense_v.", ".v_proj.")
                                   for k in keys}  # the same pairs, only the names changed


def test_unknown_key_adapter_differs_from_its_source_by_one_key(tmp_path):
    src = peft_folder(tmp_path / "pirate")
    adapters.make_derived(tmp_path, "odd", "pirate", adapters.add_unknown_key)
    config = json.loads((tmp_path / "odd" / "adapter_config.json").read_text())
    original = json.loads((src / "adapter_config.json").read_text())
    assert config == {**original, adapters.UNKNOWN_KEY: True}
    assert sha256_file(tmp_path / "odd" / "adapter_model.safetensors") == \
        sha256_file(src / "adapter_model.safetensors")


def test_dataset_manifest_version_follows_the_file(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "b"}\n')
    one = adapters.dataset_manifest(data)
    data.write_text('{"prompt": "a", "answer": "c"}\n')
    assert adapters.dataset_manifest(data)["sha256"] != one["sha256"] and one["examples"] == 1


@pytest.mark.slow
def test_training_is_reproducible_and_cached(tmp_path, monkeypatch):
    """Two short runs write identical adapter bytes; make_trained keeps a folder whose inputs match
    and remakes it when they change."""
    recipe = Recipe(steps=2, batch=2)
    examples = load_examples(adapters.DATA)[:4]
    one = train(MODEL, examples, recipe, tmp_path / "a")
    two = train(MODEL, examples, recipe, tmp_path / "b")
    assert one["losses"] == two["losses"]
    assert sha256_file(tmp_path / "a" / "adapter_model.safetensors") == \
        sha256_file(tmp_path / "b" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "SmolLM2-135M-Instruct"  # no local path in the file

    manifest = adapters.dataset_manifest(adapters.DATA)
    weights = sha256_file(MODEL / "model.safetensors")
    runs = []
    monkeypatch.setattr(adapters, "train", lambda *a, **k: runs.append(a) or train(*a, **k))
    monkeypatch.setattr(adapters, "load_examples", lambda _p: examples)
    assert adapters.make_trained(tmp_path, "x", MODEL, manifest, recipe, weights, None)
    assert not adapters.make_trained(tmp_path, "x", MODEL, manifest, recipe, weights, None)
    assert len(runs) == 1
    record = json.loads((tmp_path / "x" / "keel-base.json").read_text())
    assert record["weights_sha256"] == {"model.safetensors": weights} and record["perturbation"] is None
    assert adapters.make_trained(tmp_path, "x", MODEL, manifest, Recipe(steps=1, batch=2), weights, None)


@pytest.mark.slow
def test_mismatched_adapter_records_the_perturbed_base(tmp_path, monkeypatch):
    examples = load_examples(adapters.DATA)[:2]
    monkeypatch.setattr(adapters, "load_examples", lambda _p: examples)
    weights = sha256_file(MODEL / "model.safetensors")
    adapters.make_trained(tmp_path, "m", MODEL, adapters.dataset_manifest(adapters.DATA), Recipe(steps=1, batch=2),
                          weights, adapters.PERTURBATION)
    record = json.loads((tmp_path / "m" / "keel-base.json").read_text())
    assert record["perturbation"] == {"tensor": adapters.PERTURBATION.tensor, "scale": adapters.PERTURBATION.scale}
    assert record["weights_sha256"]["model.safetensors"] != weights
    assert sha256_file(MODEL / "model.safetensors") == weights  # the served base is untouched
    kept = tmp_path / "m" / PERTURBED_BASE  # the base it was trained on, to register it against
    assert sha256_file(kept / "model.safetensors") == record["weights_sha256"]["model.safetensors"]
    perturbed, served = load_file(kept / "model.safetensors"), load_file(MODEL / "model.safetensors")
    differ = [k for k in served if k in perturbed and not torch.equal(served[k], perturbed[k])]
    assert differ == [adapters.PERTURBATION.tensor]


@pytest.mark.slow
def test_training_leaves_the_process_thread_count_as_it_found_it(tmp_path):
    """train() sets torch's process-wide thread count for itself only: a test session that trains the
    adapters in-process (tests/e2e/test_lora_mesh.py) keeps the count its other tests run at."""
    before = torch.get_num_threads()
    recipe = Recipe(steps=1, batch=1, threads=before + 1)
    try:
        train(MODEL, load_examples(adapters.DATA)[:1], recipe, tmp_path / "a")
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
