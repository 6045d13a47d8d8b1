"""Make the LoRA adapters the tests and the demo register, under var/adapters-src/<name>/, once.

Run: python -m training.adapters [--out var/adapters-src] [--base PREPARED_MODEL_DIR]   (what `make adapters` does)

- ``pirate``: trained with PEFT on the SmolLM2 weights to answer as a pirate ("Arr, matey! ...")
  from training/data/pirate.jsonl: an adapter that visibly changes the answers.
- ``pirate-mismatched``: trained the same way (fewer steps: it only has to be bound to another
  base) on a copy of the base with one weight tensor scaled; that base is kept in its
  ``base-model/`` folder, so the adapter can be registered against the base it was trained on,
  and its keel-base.json names weights Keel does not serve.
- ``pirate-inert``: the pirate weights with every module name renamed to names the model lacks
  (its adapter_config.json too): PEFT-valid, but it would change nothing.
- ``pirate-unknown-key``: the pirate adapter with a key in adapter_config.json that no PEFT
  version defines.

Each folder is a PEFT adapter (adapter_config.json + adapter_model.safetensors) plus:
- ``keel-base.json``: the base it was trained against (weights file sha256, config.json and
  tokenizer hashes, rope_theta, vocab_size, tie_word_embeddings, weight format, the torch,
  transformers and peft versions), and the perturbation when there was one;
- ``dataset.json``: the dataset manifest (file, its sha256, example count); the sha256 of this
  file's bytes is the training-data version;
- ``keel-training.json``: the recipe, seeds, threads, losses, seconds and what the folder was
  derived from. A second run keeps every folder whose recorded inputs still match.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from shared.modelfile import source as model_source
from training.lora import Perturbation, Recipe, load_examples, sha256_file, train

DATA = Path(__file__).resolve().parent / "data" / "pirate.jsonl"
DEFAULT_OUT = Path("var/adapters-src")
DEFAULT_BASE = model_source().cache_dir
# Bumped when this script makes different files from the same inputs, so old caches are remade.
GENERATOR_VERSION = 1
PERTURBATION = Perturbation(tensor="model.layers.0.self_attn.q_proj.weight", scale=1.05)
INERT_RENAMES = {"q_proj": "query_key_value", "v_proj": "dense_v"}  # names no Llama module has
UNKNOWN_KEY = "keel_test_unknown_option"
# Refused for its base before anything else is looked at: a few steps make it a trained adapter.
MISMATCHED_RECIPE = Recipe(steps=4)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=2).encode() + b"\n"


def dataset_manifest(path: Path) -> dict:
    examples = load_examples(path)
    return {"name": path.stem, "file": f"training/data/{path.name}", "sha256": sha256_file(path),
            "examples": len(examples), "format": "jsonl: {prompt, answer} per line; user turn -> assistant turn"}


def base_record(base: Path, weights: dict[str, str], perturbation: Perturbation | None) -> dict:
    """The facts of the base an adapter was trained against (the inputs of Keel's base fingerprint)."""
    import peft
    import torch
    import transformers

    config = json.loads((base / "config.json").read_text())
    rope = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    tok = base / "hf-tokenizer"
    return {"weights_sha256": weights, "config_sha256": sha256_file(base / "config.json"),
            "rope_theta": rope, "vocab_size": config["vocab_size"],
            "tie_word_embeddings": config["tie_word_embeddings"],
            "tokenizer_sha256": sha256_file(tok / "tokenizer.json"),
            "chat_template_sha256": sha256_file(tok / "chat_template.jinja"),
            "weight_format": "safetensors float32", "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__, "peft": peft.__version__,
            "perturbation": asdict(perturbation) if perturbation else None}


def _inputs(manifest: dict, recipe: Recipe, base_weights: str, perturbation: Perturbation | None) -> dict:
    """What decides a trained folder's content; a cached folder is kept only while these are equal."""
    import peft
    import torch
    import transformers

    return {"generator": GENERATOR_VERSION, "dataset_sha256": hashlib.sha256(_canonical(manifest)).hexdigest(),
            "recipe": asdict(recipe), "base_weights_sha256": base_weights,
            "perturbation": asdict(perturbation) if perturbation else None,
            "libraries": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "peft": peft.__version__}}


def _cached(folder: Path, inputs: dict) -> bool:
    record = folder / "keel-training.json"
    # Compared as stored (JSON has no tuples).
    return record.exists() and json.loads(record.read_text()).get("inputs") == json.loads(json.dumps(inputs))


def _write_records(folder: Path, manifest: dict, base: dict, inputs: dict, facts: dict, derived: str = "") -> None:
    (folder / "dataset.json").write_bytes(_canonical(manifest))
    (folder / "keel-base.json").write_bytes(_canonical(base))
    training = {"inputs": inputs, "training_data_version": inputs["dataset_sha256"],
                "losses": facts.get("losses"), "seconds": facts.get("seconds"), "derived_from": derived}
    (folder / "keel-training.json").write_bytes(_canonical(training))


def make_trained(out: Path, name: str, base: Path, manifest: dict, recipe: Recipe, base_weights: str,
                 perturbation: Perturbation | None) -> bool:
    """Train ``name`` unless its cached folder matches; True when it was (re)made."""
    folder = out / name
    inputs = _inputs(manifest, recipe, base_weights, perturbation)
    if _cached(folder, inputs):
        return False
    tmp = out / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    facts = train(base, load_examples(DATA), recipe, tmp, perturbation)
    _write_records(tmp, manifest, base_record(base, facts["base_weights_sha256"], perturbation), inputs, facts)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # a folder appears whole or not at all
    return True


def make_derived(out: Path, name: str, source: str, change) -> None:
    """Copy ``source``'s folder to ``name`` and apply ``change(folder)``; redone whenever the source is."""
    folder, tmp = out / name, out / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out / source, tmp)
    change(tmp)
    record = json.loads((tmp / "keel-training.json").read_text())
    record["derived_from"] = f"{source}: {change.__doc__.strip()}"
    (tmp / "keel-training.json").write_bytes(_canonical(record))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def rename_modules(folder: Path) -> None:
    """every target module renamed to a name the model lacks (weights keys and adapter_config.json)"""
    from safetensors.torch import load_file, save_file

    def renamed(key: str) -> str:
        for old, new in INERT_RENAMES.items():
            key = key.replace(f".{old}.", f".{new}.")
        return key
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({renamed(k): v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = sorted(INERT_RENAMES.get(m, m) for m in config["target_modules"])
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def add_unknown_key(folder: Path) -> None:
    """adapter_config.json given a key no PEFT version defines"""
    config = json.loads((folder / "adapter_config.json").read_text())
    config[UNKNOWN_KEY] = True
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def make_all(out: Path, base: Path, recipe: Recipe = Recipe()) -> list[str]:
    """Every adapter of this module under ``out``; returns the names (re)made."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = dataset_manifest(DATA)
    base_weights = sha256_file(base / "model.safetensors")
    made = ["pirate"] if make_trained(out, "pirate", base, manifest, recipe, base_weights, None) else []
    for name, change in (("pirate-inert", rename_modules), ("pirate-unknown-key", add_unknown_key)):
        if made or not (out / name).exists():
            make_derived(out, name, "pirate", change)
            made.append(name)
    if make_trained(out, "pirate-mismatched", base, manifest, MISMATCHED_RECIPE, base_weights, PERTURBATION):
        made.append("pirate-mismatched")
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--base", type=Path, default=DEFAULT_BASE)
    args = ap.parse_args(argv)
    made = make_all(args.out, args.base)
    print(f"adapters ready under {args.out}" + (f" (made: {', '.join(made)})" if made else " (cached)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
