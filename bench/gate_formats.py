"""The quality gate of every weight format on the real model; stores the results the stage reads at start.

Probe set: the 200 chat prompts of bench/bench_inference.py (10 forms x 20 subjects), each followed by
float32's greedy answer of --answer-tokens tokens (transformers `generate`, batches of 20, eos ignored).
Every format reads the same sequences (teacher forcing) and is compared with float32 at each answer
position (services/inference/gate.py). Results go to var/gate/<model sha256>.json (KEEL_VAR_DIR);
thresholds come from config/inference.yaml (formats.gate).

Run: .venv/bin/python bench/gate_formats.py [--prompts 200] [--answer-tokens 32] [--threads 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.bench_inference import MODEL, prompts  # noqa: E402
from services.inference import config as inf_config  # noqa: E402
from services.inference import gate  # noqa: E402
from services.inference.formats import gate_path  # noqa: E402
from services.inference.model import DTYPES, convert_model, load_model  # noqa: E402
from services.inference.warmcache import model_sha256  # noqa: E402


@torch.inference_mode()
def answers(model, tok, ids: list[list[int]], tokens: int, batch: int = 20) -> list[gate.Sequence]:
    """Each prompt followed by float32's greedy continuation (left-padded batches)."""
    out = []
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else 2
    for i in range(0, len(ids), batch):
        chunk = ids[i:i + batch]
        width = max(map(len, chunk))
        x = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=pad)
        for p, row in zip(chunk, gen):
            out.append(gate.Sequence(tuple(p) + tuple(row[width:].tolist()), len(p)))
        print(f"answers {i + len(chunk)}/{len(ids)}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default=",".join(d for d in DTYPES if d != "float32"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    limits = inf_config.load().formats.gate
    tok = AutoTokenizer.from_pretrained(str(MODEL / "hf-tokenizer"))  # nosec B615 (local directory, no hub)
    reference = load_model(MODEL, "float32")
    t0 = time.perf_counter()
    seqs = answers(reference, tok, prompts(tok, args.prompts), args.answer_tokens)
    candidates = {f: convert_model(reference, f) for f in args.formats.split(",")}
    results = gate.evaluate(reference, candidates, seqs)
    sha = model_sha256(MODEL)
    path = gate_path(sha)
    gate.store(path, sha, results, f"{len(seqs)} prompts of bench/bench_inference.py + {args.answer_tokens} "
                                   "float32 greedy tokens, teacher-forced")
    print(f"\n{len(seqs)} sequences, {results[0].positions} scored positions, {time.perf_counter() - t0:.0f} s; "
          f"stored in {path}\n")
    print("| format | mean KL (nats) | p95 KL | greedy agreement | gate |")
    print("|---|---|---|---|---|")
    for r in results:
        fails = r.failures(limits)
        print(f"| {r.format} | {r.kl_mean:.4f} | {r.kl_p95:.4f} | {r.greedy_agreement:.2%} | "
              f"{'passes' if not fails else 'fails: ' + '; '.join(fails)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
