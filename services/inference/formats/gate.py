"""The quality gate of every weight format on the real model; stores the results the stage reads at start.

Prompt set: services/inference/formats/gate_prompts.json, the 200 chat prompts of gateprompts.py
(10 forms x 20 subjects, chat template) as token ids. Every format reads the same sequences (teacher
forcing) and is compared with float32 at each position from the first token of the user's text to the
end of the assistant header (quality.py). Results go to var/gate/<model sha256>.json (KEEL_VAR_DIR),
where the stage's own gate at first start (formats.gate_at_start, startgate.py) stores them too;
thresholds come from config/inference.yaml (formats.gate).

Run: .venv/bin/python -m services.inference.formats.gate [--prompts N] [--threads 2]
     .venv/bin/python -m services.inference.formats.gate --write-prompts  # re-render the prompt file (tokenizer)
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.inference.formats import gateprompts, quality
from services.inference.formats.selection import FormatsConfig, gate_path
from services.inference.model.digest import model_sha256
from services.inference.model.loader import load_model, model_in_format
from shared import config
from shared.modelfile import source as model_source

PROMPTS = 200


@dataclass(frozen=True)
class _FormatsSection:
    """The one block of config/inference.yaml the gate reads (the whole file is still validated)."""

    formats: FormatsConfig = field(default_factory=FormatsConfig)


def render_prompts(model: Path) -> list[quality.Sequence]:
    """The first PROMPTS chat prompts, each scored from the first token of the user's text (the shared
    system preamble before it says nothing about a format) to the end of the assistant header."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model / "hf-tokenizer"))  # nosec B615 (local directory, no hub)
    empty = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)
    empty = list(empty["input_ids"] if hasattr(empty, "keys") else empty)
    out = []
    for p in gateprompts.chat_prompts(tok, PROMPTS):
        start = next(i for i, (a, b) in enumerate(zip(p, empty)) if a != b)
        out.append(quality.Sequence(tuple(p), max(1, start)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=model_source().cache_dir,
                    help="a prepared model folder or a GGUF file (default: the served model's)")
    # float16 is left out by default: this CPU has no fp16 GEMM and one pass takes seconds.
    ap.add_argument("--formats", default="bfloat16,int8,int4,gguf,gguf_f32")
    ap.add_argument("--write-prompts", action="store_true", help=f"write {gateprompts.PROMPTS_FILE.name} and exit")
    args = ap.parse_args(argv)
    if args.write_prompts:
        seqs = render_prompts(args.model)
        gateprompts.write(seqs)
        print(f"{len(seqs)} sequences, sha256 {gateprompts.digest(seqs)}, written to {gateprompts.PROMPTS_FILE}")
        return 0
    torch.set_num_threads(args.threads)
    limits = config.load("inference", _FormatsSection).formats.gate
    reference = load_model(args.model, "float32")
    t0 = time.perf_counter()
    seqs = gateprompts.load(args.prompts)
    candidates = {f: model_in_format(reference, f, args.model) for f in args.formats.split(",")}
    results = quality.evaluate(reference, candidates, seqs,
                            lambda i: i % 20 or print(f"scored {i}/{len(seqs)}", flush=True))
    sha = model_sha256(args.model)
    path = gate_path(sha)
    kept = [r for f, r in quality.load(path, sha).items() if f not in candidates]  # other formats' results stay
    quality.store(path, sha, [*kept, *results], gateprompts.describe(len(seqs)))
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
