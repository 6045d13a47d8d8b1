"""Train one LoRA adapter with PEFT on the SmolLM2 safetensors cache (var/model), reproducibly.

Reproducible means: fixed seeds (the LoRA init and the data order), deterministic torch algorithms,
a fixed thread count, no dropout, float32 throughout, and the data in the file's order shuffled by a
seeded generator. Two runs on the same machine kind and library versions write the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# The name written into adapter_config.json instead of the local path the model was loaded from,
# so that the file does not depend on where the repository lives.
BASE_NAME = "SmolLM2-135M-Instruct"
PERTURBED_BASE = "base-model"  # the perturbed base an adapter was trained on, kept beside it


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights besides the data and the base."""
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 40
    batch: int = 4
    lr: float = 2e-3
    seed: int = 1234
    threads: int = 2


@dataclass(frozen=True)
class Perturbation:
    """A change to the base weights before training: ``tensor`` multiplied by ``scale``. An adapter
    trained this way was trained against another base than the one Keel serves."""
    tensor: str
    scale: float


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_examples(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, row in enumerate(rows):
        if set(row) != {"prompt", "answer"}:
            raise ValueError(f"{path}:{i + 1}: each line needs exactly 'prompt' and 'answer'")
    return rows


def _batches(examples: list[dict], recipe: Recipe):
    """Batches in a seeded order: each pass over the data is one shuffle of the file's order."""
    rng = random.Random(recipe.seed)
    order: list[int] = []
    while True:
        if not order:
            order = list(range(len(examples)))
            rng.shuffle(order)
        take, order = order[:recipe.batch], order[recipe.batch:]
        yield [examples[i] for i in take]


def _encode(tokenizer, batch: list[dict]):
    """Input ids, attention mask and labels; the loss covers the answer and its end-of-turn only."""
    import torch

    rows = []
    for ex in batch:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ex["prompt"]}],
                                               tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(ex["answer"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, mask, labels


def save_perturbed_base(model, p: Perturbation, folder: Path) -> dict:
    """Apply ``p`` to ``model`` in place and save the base it now is to ``folder`` (config.json and
    model.safetensors, as var/model holds them), so that the adapter can be registered against the
    base it was trained on; returns its weights file's sha256."""
    import torch

    with torch.no_grad():
        model.get_parameter(p.tensor).mul_(p.scale)
    model.hf_quantizer = None  # plain float32 tensors, as services/inference/model/modelcache.py saves var/model
    model.save_pretrained(folder)
    return {"model.safetensors": sha256_file(folder / "model.safetensors")}


def train(base_dir: Path, examples: list[dict], recipe: Recipe, out: Path,
          perturbation: Perturbation | None = None) -> dict:
    """Train, write the PEFT folder to ``out``, return the facts of the run (losses, the base
    weights' sha256 per file, seconds). With a ``perturbation`` the base is perturbed first and
    saved under ``out / PERTURBED_BASE``."""
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    torch.use_deterministic_algorithms(True)
    # The process's thread count is torch's, shared with whatever else runs in it (a test session):
    # set for the training only, then put back.
    before = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        # bandit B615 does not apply: local files only.
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir / "hf-tokenizer"))  # nosec B615
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)  # nosec B615
        weights = {"model.safetensors": sha256_file(base_dir / "model.safetensors")}
        if perturbation is not None:
            weights = save_perturbed_base(model, perturbation, out / PERTURBED_BASE)
        model.config.use_cache = False
        config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.target_modules),
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
        losses = []
        batches = _batches(examples, recipe)
        for _ in range(recipe.steps):
            ids, mask, labels = _encode(tokenizer, next(batches))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(round(loss.item(), 4))
            if len(losses) % 10 == 0:
                print(f"step {len(losses)}/{recipe.steps} loss {losses[-1]} ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
        model.peft_config["default"].base_model_name_or_path = BASE_NAME
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        return {"losses": losses, "base_weights_sha256": weights,
                "seconds": round(time.monotonic() - started, 1), "recipe": asdict(recipe)}
    finally:
        torch.set_num_threads(before)
