"""The grammar engines side by side on SmolLM2's vocabulary: compile time and mask time per token of
one JSON Schema, llguidance (what services/inference/engine/grammar.py uses) against outlines-core.

    make bench-deps    # outlines-core is a bench-only pin of requirements.lock
    .venv/bin/python -m bench.bench_grammar_engines [--reps 20]

Both walk the same valid answer token by token, computing the mask before each token; the figures
are medians over `--reps` walks, and the ratios are outlines-core's over llguidance's in the run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import numpy as np
import outlines_core
from outlines_core.json_schema import build_regex_from_schema

from bench.lib.machine import machine_line
from shared.modelfile import source as model_source

TOKENIZER = model_source().cache_dir / "hf-tokenizer" / "tokenizer.json"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "addr": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    "required": ["name", "age", "tags", "addr"], "additionalProperties": False}
ANSWER = '{"name":"Alice","age":33,"tags":["a","b"],"addr":{"city":"Paris"}}'


def byte_vocabulary(eos: int) -> dict[bytes, list[int]]:
    """tokenizer.json's byte-level BPE tokens as bytes (GPT-2's byte-to-unicode mapping undone)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    back = {chr(c): b for b, c in zip(bs, cs)}
    out: dict[bytes, list[int]] = {}
    for s, i in json.loads(TOKENIZER.read_text())["model"]["vocab"].items():
        if i != eos:
            out.setdefault(bytes(back[c] for c in s), []).append(i)
    return out


def walk_llguidance(tok, ids) -> tuple[float, float]:
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)), log_level=0)
    compile_s = time.perf_counter() - t0
    masks = []
    for i in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        masks.append(time.perf_counter() - t0)
        assert m.consume_token(i), m.get_error()
    return compile_s, statistics.median(masks)


def walk_outlines(vocab, n_vocab: int, ids) -> tuple[float, float]:
    t0 = time.perf_counter()
    guide = outlines_core.Guide(outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))
    compile_s = time.perf_counter() - t0
    mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    masks = []
    for i in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        masks.append(time.perf_counter() - t0)
        guide.advance(i)
    return compile_s, statistics.median(masks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    tok = llguidance.LLTokenizer(TOKENIZER.read_text(), eos_token=[2])
    ids = tok.tokenize_str(ANSWER)
    vocab = outlines_core.Vocabulary(2, byte_vocabulary(2))
    runs = {"llguidance": [], "outlines-core": []}
    for _ in range(args.reps):  # alternated, so both see the same machine
        runs["llguidance"].append(walk_llguidance(tok, ids))
        runs["outlines-core"].append(walk_outlines(vocab, tok.vocab_size, ids))
    med = {k: (statistics.median(c for c, _ in v) * 1e3, statistics.median(m for _, m in v) * 1e6)
           for k, v in runs.items()}
    print(f"{len(ids)}-token answer, {args.reps} walks each; llguidance {llguidance.__version__}")
    for name, (c, m) in med.items():
        print(f"  {name:<14} compile {c:8.2f} ms   mask per token (median) {m:7.1f} us")
    print(f"  outlines-core / llguidance: compile {med['outlines-core'][0] / med['llguidance'][0]:.1f}x, "
          f"mask {med['outlines-core'][1] / med['llguidance'][1]:.2f}x")
    print(machine_line())


if __name__ == "__main__":
    main()
