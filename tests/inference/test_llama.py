"""Keel's own Llama module (llama.py) computes what transformers' LlamaForCausalLM computes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from services.inference.model.forward import LlamaRunner
from services.inference.model.llama import ModelConfig, load
from services.inference.model.loader import load_model
from shared.config import ROOT_DIR
from shared.errors import InvalidInput
from testing.tiny import hf_twin, save_model, tiny_model
from tests.inference.helpers import prompt


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-files")


@pytest.fixture(scope="module")
def twin(tiny, files):
    return hf_twin(tiny, files)


def test_logits_are_bitwise_those_of_transformers_reading_the_same_files(twin, files):
    keel = load(files)
    with torch.inference_mode():
        for seed, length in ((0, 1), (1, 2), (2, 40), (3, 130)):
            x = torch.tensor([prompt(seed, length)])
            assert torch.equal(keel(x).logits, twin(x).logits)


def test_the_same_weights_elsewhere_in_memory_agree_to_rounding(tiny, twin):
    """tiny's weights live in heap memory, the twin's in the mapped file: a small-M GEMM may pick
    another kernel path by alignment, so a one-token pass can differ in the last bits (not above)."""
    with torch.inference_mode():
        for seed, length in ((0, 1), (1, 7), (2, 40)):
            x = torch.tensor([prompt(seed, length)])
            torch.testing.assert_close(tiny(x).logits, twin(x).logits, rtol=1e-5, atol=1e-4)


def test_a_batch_of_rows_gives_each_row_its_own_logits(tiny):
    """Each row of a batch gets its own logits: a row mixed up with another would differ by whole
    units. A GEMM over 3 rows and over 1 may sum in another order, so the last bits may differ
    (seen: up to 4.1e-5 on logits up to ~21 in magnitude), hence the same 1e-4 bound as above."""
    rows = torch.tensor([prompt(s, 9) for s in range(3)])
    with torch.inference_mode():
        batched = tiny(rows).logits
        for i in range(3):
            torch.testing.assert_close(batched[i], tiny(rows[i:i + 1]).logits[0], rtol=1e-5, atol=1e-4)


def test_saved_model_loads_back_equal_with_the_tied_head(tiny, tmp_path):
    loaded = load(save_model(tiny, tmp_path))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert loaded.state_dict().keys() == tiny.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), tiny.state_dict().values()))
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training


def test_greedy_engine_pass_matches_transformers_generate(tiny, twin):
    runner = LlamaRunner(tiny)
    runner.calibrate_invariant_sizes(16)
    for seed in range(3):
        ids = prompt(seed, 7 + seed * 5)
        ref = twin.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
        cache = runner.new_cache(len(ids) + 24)
        out = [int(runner.prefill(ids, cache).argmax())]
        while len(out) < 24:
            out.append(int(runner.decode([out[-1]], [cache])[0].argmax()))
        assert out == ref


def test_tiny_model_keeps_the_padding_row_zero_and_the_config_values():
    m = tiny_model()
    c = m.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.rope_theta) == (64, 4, 2, 100000.0)
    assert not m.model.embed_tokens.weight[c.pad_token_id].any()
    assert m.lm_head.weight is m.model.embed_tokens.weight


@pytest.mark.parametrize("change,field", [({"model_type": "gpt2"}, "'gpt2' model; Keel implements llama, mistral"),
                                          ({"hidden_act": "gelu"}, "hidden_act"),
                                          ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}},
                                           "rope_parameters.rope_type"),
                                          ({"attention_bias": True}, "attention_bias")])
def test_a_config_this_module_does_not_implement_is_refused(tiny, tmp_path, change, field):
    save_model(tiny, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(InvalidInput) as e:
        load_model(tmp_path)
    assert e.value.reason == "UNSUPPORTED_MODEL" and field in str(e.value)


@pytest.mark.parametrize("change,named", [({"num_hidden_layers": 3}, "model.layers.2"),
                                          ({"intermediate_size": 96}, "size mismatch")])
def test_weights_that_do_not_fit_the_config_are_refused(tiny, tmp_path, change, named):
    save_model(tiny, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(InvalidInput) as e:
        load_model(tmp_path)
    assert e.value.reason == "UNSUPPORTED_MODEL" and named in str(e.value)


def test_config_reads_the_older_top_level_rope_theta():
    c = ModelConfig.from_json({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_key_value_heads": 1,
                               "max_position_embeddings": 32, "rope_theta": 500.0})
    assert (c.rope_theta, c.head_dim, c.tie_word_embeddings) == (500.0, 4, False)


@pytest.mark.slow
def test_the_serving_process_imports_neither_transformers_nor_the_compiler():
    """Both cost seconds of every restart: transformers (the model is llama.py's) and torch._inductor
    (which torch.use_deterministic_algorithms would import to set its own flag)."""
    code = ("import sys, torch, services.inference.server, shared.server\n"
            "from services.inference.engine.warmup import set_deterministic\n"
            "set_deterministic('cpu')\n"
            "print('transformers' in sys.modules, 'torch._inductor' in sys.modules,"
            " torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT_DIR)
    assert out.stdout.split() == ["False", "False", "True", "True"]
