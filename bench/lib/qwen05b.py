"""A model of the size teams run on CPUs: the shapes of Qwen2.5-0.5B-Instruct with random weights, as
an F16 GGUF written by gguf-py and quantized from it by llama.cpp's own quantizer, built once and
cached under var/ like testing/quantized.py's files.

    f16()                   # var/qwen05b/qwen05b-F16-<hash>/model.gguf
    model_file("Q4_K_M")    # llama.cpp's Q4_K_M of it (testing/quantized.quantized), also Q5_K_M, Q6_K, Q8_0

Shapes (QWEN05B): arch qwen2, 24 layers, hidden 896, 14 query and 2 KV heads of 64, intermediate 4864,
vocabulary 151936, tied embeddings, q/k/v biases, rope theta 1e6, rms eps 1e-6, context 32768.
The file is laid out as llama.cpp's converter writes Qwen2 (the norms and biases F32, every matrix F16,
q/k rows unpermuted: qwen2's rotary is NEOX). Weights and biases are N(0, 0.02), norms 1: random
weights, so an answer ends at a random eos (benchmarks force their lengths with ignore_eos).

Tokenizer: the shipped SmolLM2's (testing/tinymodels.py's fields: byte-level BPE, pre "smollm",
ChatML template, eos <|im_end|>), whose 49152 tokens are followed by "<filler-N>" tokens up to the
vocabulary's size: NORMAL tokens that no merge produces, so a text's ids are SmolLM2's, and a
sampled filler decodes to its name. Keel's tokenizer stage and llama.cpp both load it.

Hidden 896 is not a multiple of 256, so llama.cpp quantizes the matrices whose rows are 896 long to
its fallback type and uses the K-quants only where the rows are 4864 long (ffn_down), as for the real
model's GGUFs: Q4_K_M = 12 Q4_K + 12 Q6_K + 132 Q5_0 + 13 Q8_0 (attn_v and the tied embedding), 378 MiB;
Q5_K_M = Q5_K + Q6_K + Q5_1 + Q8_0, 399 MiB; Q6_K = 24 Q6_K + 145 Q8_0, 481 MiB; Q8_0, 505 MiB.

Run: .venv/bin/python -m bench.lib.qwen05b [--types Q4_K_M,Q5_K_M,Q6_K,Q8_0]
     (builds the files, then loads each in Keel's gguf format and in llama-cpp-python and prints both
     next tokens after one prompt: random weights have near-ties, so they may differ)
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from shared.config import ROOT_DIR
from testing.cache import built_once
from testing.quantized import quantized
from testing.tinymodels import _add_tokenizer, _tokenizer_fields

CACHE = Path(ROOT_DIR) / "var" / "qwen05b"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SEED = 0
STD = 0.02
FILLER = "<filler-{}>"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int = 32768
    theta: float = 1e6
    eps: float = 1e-6


QWEN05B = Shape(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151936)


def tokenizer_fields(vocab: int) -> dict[str, object]:
    """SmolLM2's tokenizer.* fields with its token lists padded by filler tokens to `vocab` entries."""
    fields = _tokenizer_fields()
    real = len(fields["tokenizer.ggml.tokens"])
    if vocab < real:
        raise ValueError(f"a vocabulary of {vocab} cannot hold the tokenizer's {real} tokens")
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + [FILLER.format(i) for i in range(real, vocab)]
    fields["tokenizer.ggml.token_type"] = (fields["tokenizer.ggml.token_type"]
                                           + [int(gguf.TokenType.NORMAL)] * (vocab - real))
    return fields


def tensors(shape: Shape, seed: int = SEED):
    """(GGUF name, array) of every tensor in llama.cpp's order: matrices F16, vectors F32."""
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * STD).astype(np.float16)

    def vector(n: int) -> np.ndarray:
        return rng.standard_normal(n, dtype=np.float32) * STD

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    yield "token_embd.weight", matrix(shape.vocab, shape.hidden)
    for i in range(shape.layers):
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", np.ones(shape.hidden, dtype=np.float32)
        yield blk + "attn_q.weight", matrix(q, shape.hidden)
        yield blk + "attn_q.bias", vector(q)
        yield blk + "attn_k.weight", matrix(kv, shape.hidden)
        yield blk + "attn_k.bias", vector(kv)
        yield blk + "attn_v.weight", matrix(kv, shape.hidden)
        yield blk + "attn_v.bias", vector(kv)
        yield blk + "attn_output.weight", matrix(shape.hidden, q)
        yield blk + "ffn_norm.weight", np.ones(shape.hidden, dtype=np.float32)
        yield blk + "ffn_gate.weight", matrix(shape.ffn, shape.hidden)
        yield blk + "ffn_up.weight", matrix(shape.ffn, shape.hidden)
        yield blk + "ffn_down.weight", matrix(shape.hidden, shape.ffn)
    yield "output_norm.weight", np.ones(shape.hidden, dtype=np.float32)


def write(path: Path, shape: Shape, seed: int = SEED) -> Path:
    """The F16 GGUF of `shape` with random weights at `path`."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("keel-random-qwen2")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_vocab_size(shape.vocab)
    _add_tokenizer(writer, tokenizer_fields(shape.vocab))
    for name, data in tensors(shape, seed):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _key(shape: Shape) -> str:
    """The generator's inputs (shape, seed, std) and its code (this file's source)."""
    blob = json.dumps({"shape": asdict(shape), "seed": SEED, "std": STD})
    return hashlib.sha256(blob.encode() + Path(__file__).read_bytes()).hexdigest()[:12]


def f16(shape: Shape = QWEN05B) -> Path:
    """The cached F16 GGUF of `shape`."""
    out = built_once(CACHE / f"qwen05b-F16-{_key(shape)}", lambda folder: write(folder / "model.gguf", shape))
    return out / "model.gguf"


def model_file(ftype: str) -> Path:
    """The 0.5B-shaped model in `ftype` ("F16" or a llama-quantize name: TYPES), cached."""
    return f16() if ftype == "F16" else quantized(f16(), ftype)


def next_tokens(path: Path, ids: list[int]) -> tuple[int, int]:
    """The greedy next token after `ids` by Keel's gguf format and by llama.cpp, on the file at `path`."""
    import llama_cpp
    import torch

    from services.inference.model.loader import load_model

    with torch.inference_mode():
        keel = int(load_model(path, "gguf")(torch.tensor([ids])).logits[0, -1].argmax())
    # logits_all: without it llama-cpp-python 0.3.36's `scores` row of the last token is not its logits
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, seed=0, verbose=False, logits_all=True)
    llm.eval(ids)
    theirs = int(np.asarray(llm.scores[len(ids) - 1]).argmax())
    llm.close()
    return keel, theirs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", type=lambda s: s.split(","), default=list(TYPES))
    args = ap.parse_args(argv)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2]  # a few of SmolLM2's ids, then <|im_end|>
    for ftype in args.types:
        path = model_file(ftype)
        keel, theirs = next_tokens(path, ids)
        print(f"{ftype}: {path} ({path.stat().st_size / 2**20:.0f} MiB): next token Keel gguf {keel}, "
              f"llama.cpp {theirs}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
