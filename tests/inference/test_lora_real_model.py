"""LoRA on the real SmolLM2 weights: PEFT's unmerged outputs, batch invariance, and the stage's checks."""
from __future__ import annotations

import pytest
import torch

from services.inference.lora.registration import register
from services.inference.lora.registry import LoraConfig
from services.inference.lora.startup import check_adapters, running_base
from services.inference.model.digest import model_sha256
from services.inference.model.forward import LlamaRunner, Segment
from services.inference.model.loader import load_model
from shared.modelfile import source as model_source
from testing.lora import load_slots, make_adapter, peft_logits, tokenizer
from tests.inference.helpers import clone_cache

MODEL = model_source().cache_dir
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make model` first")]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-lora")
    model = load_model(MODEL)
    folders = [make_adapter(model, root / "qv", seed=0, rank=8, targets=("q_proj", "v_proj"), b_std=0.05),
               make_adapter(model, root / "mlp", seed=1, rank=4, targets=("o_proj", "up_proj", "down_proj"),
                            b_std=0.05)]
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(16)
    runner.lora = load_slots(model, folders)
    return model, runner, folders


def _chat(text: str) -> list[int]:
    tok = tokenizer()
    return tok.encode_ids(tok.render_chat([("user", text)]))


def test_matches_peft_unmerged_forward_on_the_real_weights(real):
    model, runner, folders = real
    ids = _chat("What is the capital of France?")
    for slot, folder in enumerate(folders, start=1):
        ref = peft_logits(model, folder, ids)
        got = runner.forward([Segment(runner.new_cache(len(ids) + 1), ids, slot)])[0]
        torch.testing.assert_close(got, ref[-1], rtol=1e-3, atol=1e-3)
        assert int(got.argmax()) == int(ref[-1].argmax())


def test_rows_alone_equal_rows_in_a_mixed_batch_of_16_on_the_real_weights(real):
    _, runner, _ = real
    slots = [i % 3 for i in range(16)]  # two adapters and the base
    texts = ["Name a colour.", "What is 2+2?", "Say hi.", "Give a fruit."]
    caches = [runner.new_cache(64) for _ in slots]
    tokens = [int(runner.forward([Segment(c, _chat(texts[i % 4]) + [i], s)])[0].argmax())
              for i, (c, s) in enumerate(zip(caches, slots))]
    same = total = 0
    for _ in range(2):
        alone = [runner.forward([Segment(clone_cache(c), [t], s)])[0]
                 for c, t, s in zip(caches, tokens, slots)]
        batch = runner.forward([Segment(c, [t], s) for c, t, s in zip(caches, tokens, slots)])
        same += sum(torch.equal(a, b) for a, b in zip(alone, batch))
        total += len(slots)
        tokens = [int(r.argmax()) for r in batch]
    assert same == total == 32


def test_registered_on_the_real_base_and_accepted_by_the_stage_checks(real, tmp_path):
    model, _, folders = real
    cfg = LoraConfig(registry_dir=str(tmp_path / "registry"))
    sha = model_sha256(MODEL)
    runner = LlamaRunner(model)
    runner.calibrate_invariant_sizes(16)
    m = register(folders[0], "qv", "1", running_base(runner, MODEL, sha, "float32"), cfg)
    assert m.base["rope_theta"] == "100000.0" and m.base["tie_word_embeddings"] == "true"
    table = check_adapters(cfg, runner, MODEL, sha, "float32")
    assert [(s.name, s.state, s.slot) for s in table.states] == [("qv@1", "accepted", 1)]
    assert table.states[0].drift["p95"] == 0.0
