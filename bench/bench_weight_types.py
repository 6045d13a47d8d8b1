"""Top-1 agreement of Keel's gguf formats with llama.cpp on the same llama.cpp-quantized file, per type.

SmolLM2-135M re-quantized by llama.cpp's own quantizer (testing/quantized.py: from the F32 GGUF of the
shipped weights) to each type; the quality gate's prompts (formats/gate_prompts.json, teacher-forced),
and at each scored position the argmax of Keel's logits (gguf_f32: float32 activations; gguf: 8-bit)
against llama.cpp's (llama-cpp-python, logits_all, F32 KV cache, 2 threads) over the same tokens.
An agreement figure, not a speed: the host may be shared.

    .venv/bin/python -m bench.bench_weight_types [--types Q4_K_M,Q6_K,Q8_0] [--prompts 200]
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np
import torch

from bench.lib.machine import machine_line
from services.inference.formats import gateprompts
from services.inference.model.loader import load_model
from testing import quantized


def llamacpp_top1(path, seqs) -> list[np.ndarray]:
    """llama.cpp's argmax at each scored position of each sequence."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, seed=0, verbose=False, logits_all=True,
                          type_k=0, type_v=0)
    out = []
    for seq in seqs:
        llm.reset()
        llm.eval(list(seq.ids[:-1]))
        out.append(np.asarray(llm.scores[seq.score_from - 1:len(seq.ids) - 1]).argmax(-1))
    llm.close()
    return out


@torch.inference_mode()
def keel_top1(model, seqs) -> list[np.ndarray]:
    return [model(torch.tensor([seq.ids[:-1]])).logits[0, seq.score_from - 1:].argmax(-1).numpy() for seq in seqs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_K_M,Q6_K,Q8_0")
    ap.add_argument("--prompts", type=int, default=None, help="the first N gate prompts (default: all 200)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    seqs = gateprompts.load(args.prompts)
    print("| type | tensors | positions | gguf_f32 top-1 = llama.cpp | gguf top-1 = llama.cpp |")
    print("|---|---|---|---|---|")
    for ftype in args.types.split(","):
        path = quantized.smollm2(ftype)
        want = llamacpp_top1(path, seqs)
        n = sum(len(w) for w in want)
        cells = []
        for fmt in ("gguf_f32", "gguf"):
            got = keel_top1(load_model(path, fmt), seqs)
            cells.append(f"{sum(int((g == w).sum()) for g, w in zip(got, want)) / n:.2%}")
        mix = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2})
        print(f"| {ftype} | {' '.join(mix)} | {n} | {cells[0]} | {cells[1]} |", flush=True)
    print(machine_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
