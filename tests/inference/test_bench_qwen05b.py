"""The benchmark's 0.5B-shaped model (bench/lib/qwen05b.py), built at tiny dimensions: Keel reads the
shapes it was given, its tokenizer stage compiles the padded vocabulary and tokenizes as llama.cpp does
on the same file, the gguf format computes it, and llama.cpp loads it. And bench_serving's --model and
--ignore-eos options: the peers that run on an own file, ignore_eos on every request."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from bench import bench_serving
from bench.lib import qwen05b
from services.inference.model import ggufmodel
from services.inference.model.loader import load_model
from services.tokenizer.compiler import compile_vocab
from services.tokenizer.core import Tokenizer

TINY = qwen05b.Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=49152 + 40)
TEXT = "Hello world, what's 2+2?"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return qwen05b.write(tmp_path_factory.mktemp("qwen05b") / "model.gguf", TINY)


def test_keel_reads_the_shapes_written(tiny_file):
    config, _ = ggufmodel.read(tiny_file)
    assert (config.model_type, config.vocab_size, config.hidden_size, config.intermediate_size) == \
        ("qwen2", TINY.vocab, TINY.hidden, TINY.ffn)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == \
        (TINY.layers, TINY.heads, TINY.kv_heads, TINY.head_dim)
    assert config.tie_word_embeddings and config.attention_bias
    assert (config.rope_theta, config.eos_token_id) == (1e6, 2) and config.rms_norm_eps == pytest.approx(1e-6)


def test_the_padded_vocabulary_tokenizes_as_llama_cpp_and_decodes_fillers(tiny_file, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = Tokenizer.open(compile_vocab(tiny_file, tmp_path / "vocab.kvoc"))
    ids = list(tok.encode(TEXT).input_ids)
    llm = llama_cpp.Llama(model_path=str(tiny_file), vocab_only=True, verbose=False)
    assert llm.n_vocab() == TINY.vocab
    assert ids == llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    assert tok.decode([TINY.vocab - 1]) == qwen05b.FILLER.format(TINY.vocab - 1)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernel")
def test_the_gguf_format_and_llama_cpp_compute_it(tiny_file):
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = [1, 9690, 198, 2683, 359]
    with torch.inference_mode():
        logits = load_model(tiny_file, "gguf")(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), TINY.vocab) and torch.isfinite(logits).all()
    llm = llama_cpp.Llama(model_path=str(tiny_file), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    llm.eval(ids)
    assert np.isfinite(np.asarray(llm.scores[len(ids) - 1])).all()
    llm.close()


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        qwen05b.tokenizer_fields(1000)


def test_an_own_model_runs_only_the_llama_cpp_peers_on_its_type():
    names = ["hf-static", "llama-cpp", "generate-batch-16", "llama-cpp-batched"]
    assert bench_serving.peer_plan(names, True, "Q4_K_M") == [("llama-cpp", "Q4_K_M"), ("llama-cpp-batched", "Q4_K_M")]
    assert bench_serving.peer_plan(names, False, "Q4_1") == [
        ("hf-static", "float32"), ("hf-static", "bfloat16"), ("llama-cpp", "Q4_1"),
        ("generate-batch-16", "float32"), ("generate-batch-16", "bfloat16"), ("llama-cpp-batched", "Q4_1")]


def test_ignore_eos_reaches_every_request():
    args = bench_serving.parser().parse_args(["--model", "m.gguf", "--ignore-eos", "--concurrency", "1,16"])
    assert args.ignore_eos and str(args.model) == "m.gguf" and args.concurrency == [1, 16]
    job = bench_serving.Job(0, "hi", [1, 2], 32)
    assert bench_serving.sampling(job, args.ignore_eos).ignore_eos
    assert not bench_serving.sampling(job, bench_serving.parser().parse_args([]).ignore_eos).ignore_eos
