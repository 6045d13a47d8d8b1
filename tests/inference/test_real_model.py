"""The real SmolLM2 weights: greedy output equals transformers' generate, alone and inside a batch."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.inference.engine import Engine
from services.inference.model import load_model
from tests.inference.helpers import collect, ids, request, tiny_config

MODEL = Path("var/model")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make model` first")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain recursion to a child.", "List three prime numbers."]


@pytest.mark.asyncio
async def test_real_model_greedy_matches_generate_alone_and_batched():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(MODEL / "hf-tokenizer"))
    model = load_model(MODEL)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    engine = Engine(model, tiny_config(memory_budget_bytes=4 * 2 ** 30, max_context_tokens=2048,
                                       warmup_prompt_tokens=(16, 64, 128), warmup_max_tokens=64))
    engine.warmup()
    await engine.start()
    try:
        reqs = [request(f"r{i}", list(p), max_tokens=16) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        for r, (batched, _) in zip(reqs, together):
            alone, _ = await collect(engine, r)
            assert ids(alone) == ids(batched)
            # Explicit mask: chat prompts contain id 2 (<|im_end|>), which generate would infer as padding.
            x = torch.tensor([r.prompt_ids])
            ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=2)[0, len(r.prompt_ids):].tolist()
            assert ids(alone) == ref
    finally:
        await engine.stop(grace_s=0)
