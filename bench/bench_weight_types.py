"""Top-1 agreement of Keel's gguf formats with llama.cpp on the same llama.cpp-quantized file, per type.

SmolLM2-135M re-quantized by llama.cpp's own quantizer (testing/quantized.py: from the F32 GGUF of the
shipped weights) to each type; the quality gate's prompts (formats/gate_prompts.json, teacher-forced),
and at each scored position the argmax of Keel's logits (gguf_f32: float32 activations; gguf: 8-bit)
against llama.cpp's (llama-cpp-python, logits_all, F32 KV cache, 2 threads) over the same tokens.
llama.cpp runs each prompt in one or more of these ways (--llamacpp, a comma list; LLAMACPP_RUNS):
  prompt       the whole prompt in one eval (its batched matmul paths)
  one-token    one token per eval (n_batch 1: its decode path, the one Keel's kernels follow)
  flash-attn   the whole prompt, flash attention on
  no-repack    the whole prompt, the weights not repacked for llama.cpp's CPU extra buffer types
               (llama_model_params.use_extra_bufts = false: its interleaved Q4_0/Q8_0/Q4_K gemm)
  dequantized  the whole prompt, on the F32 GGUF of this file's dequantized weights (llama-quantize
               ALL_F32 of the file): the same weight values with float activations, llama.cpp's
               counterpart of gguf_f32
Besides the top-1 shares, a row gives the agreement with llama.cpp's first run in the list and the
median over positions of max |logit(gguf) - logit(llama.cpp)| (the logits' std is ~3).
An agreement figure, not a speed: the host may be shared.

    .venv/bin/python -m bench.bench_weight_types [--types Q4_K_M,Q6_K,Q8_0] [--prompts 200]
        [--llamacpp prompt,one-token,no-repack,flash-attn,dequantized] [--threads 2]
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager

import gguf
import numpy as np
import torch

from bench.lib.machine import machine_line
from services.inference.formats import gateprompts
from services.inference.model.loader import load_model
from testing import quantized

# name: (llama_cpp.Llama arguments beyond the common ones, llama_model_params fields, whether it reads the
# dequantized F32 file)
LLAMACPP_RUNS = {
    "prompt": ({}, {}, False),
    "one-token": ({"n_batch": 1, "n_ubatch": 1}, {}, False),
    "flash-attn": ({"flash_attn": True}, {}, False),
    "no-repack": ({}, {"use_extra_bufts": False}, False),
    "dequantized": ({}, {}, True),
}


@contextmanager
def model_params(fields: dict):
    """llama_model_params with `fields` set, for the Llama objects made inside (llama_cpp.Llama takes
    its model parameters from llama_model_default_params and exposes no use_extra_bufts)."""
    from llama_cpp import llama_cpp as lib

    default = lib.llama_model_default_params

    def with_fields():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    lib.llama_model_default_params = with_fields
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def llamacpp_logits(path, seqs, threads: int, **kwargs) -> list[np.ndarray]:
    """llama.cpp's logits [n, V] at the scored positions of each sequence."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=threads, seed=0, verbose=False,
                          logits_all=True, type_k=0, type_v=0, **kwargs)
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(list(seq.ids[:-1]))
        out.append(np.array(llm.scores[seq.score_from - 1:len(seq.ids) - 1], dtype=np.float32))
    llm.close()
    return out


@torch.inference_mode()
def keel_logits(model, seqs) -> list[np.ndarray]:
    return [model(torch.tensor([seq.ids[:-1]])).logits[0, seq.score_from - 1:].float().numpy() for seq in seqs]


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b)) / sum(len(x) for x in a)


def median_max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.median(np.concatenate([np.abs(x - y).max(-1) for x, y in zip(a, b)])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K_M,Q6_K,Q8_0")
    ap.add_argument("--prompts", type=int, default=None, help="the first N gate prompts (default: all 200)")
    ap.add_argument("--llamacpp", default="prompt", help=f"llama.cpp's runs, of: {', '.join(LLAMACPP_RUNS)}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    runs = args.llamacpp.split(",")
    if unknown := set(runs) - set(LLAMACPP_RUNS):
        ap.error(f"unknown --llamacpp run(s) {', '.join(sorted(unknown))}; known: {', '.join(LLAMACPP_RUNS)}")
    torch.set_num_threads(args.threads)
    seqs = gateprompts.load(args.prompts)
    print(f"| type | tensors | llama.cpp run | positions | gguf_f32 top-1 = llama.cpp | gguf top-1 = llama.cpp | "
          f"= llama.cpp {runs[0]} | median max abs logit diff, gguf vs llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for ftype in args.types.split(","):
        path = quantized.smollm2(ftype)
        mix = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2})
        keel = {fmt: keel_logits(load_model(path, fmt), seqs) for fmt in ("gguf_f32", "gguf")}
        first = None
        for run in runs:
            kwargs, fields, dequantized = LLAMACPP_RUNS[run]
            source = quantized.quantized(path, "F32", requantize=True) if dequantized else path
            with model_params(fields):
                want = llamacpp_logits(source, seqs, args.threads, **kwargs)
            first = want if first is None else first
            n = sum(len(w) for w in want)
            print(f"| {ftype} | {' '.join(mix)} | {run} | {n} | {agreement(keel['gguf_f32'], want):.2%} | "
                  f"{agreement(keel['gguf'], want):.2%} | {agreement(first, want):.2%} | "
                  f"{median_max_diff(keel['gguf'], want):.2g} |", flush=True)
    print(machine_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
