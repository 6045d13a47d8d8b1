"""The real SmolLM2 weights: Keel's Llama gives transformers' logits bitwise, and the engine's greedy
output equals transformers' generate, alone and inside a batch."""
from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference.engine.core import Engine
from services.inference.model.loader import load_model
from shared.controls import Controls
from shared.modelfile import source as model_source
from tests.inference.helpers import collect, ids, request, tiny_config

MODEL = model_source().cache_dir
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="run `make model` first")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain recursion to a child.", "List three prime numbers."]


@pytest.fixture(scope="module")
def reference():
    """transformers' own model of the same files, float32."""
    from transformers import AutoModelForCausalLM
    # bandit B615 does not apply: a local directory.
    return AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()  # nosec B615


def test_real_model_logits_are_bitwise_those_of_transformers(reference):
    model = load_model(MODEL)
    with torch.inference_mode():
        for ids in ([7], [1, 504, 2583, 314, 253, 1142, 28, 30], list(range(5, 600, 3))):
            x = torch.tensor([ids])
            assert torch.equal(model(x).logits, reference(x).logits)


@pytest.mark.asyncio
async def test_real_model_greedy_matches_generate_alone_and_batched(reference):
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
            ref = reference.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=2)[0, len(r.prompt_ids):].tolist()
            assert ids(alone) == ref
    finally:
        await engine.stop(grace_s=0)


@pytest.mark.asyncio
async def test_real_model_prompt_logprobs_are_transformers_next_token_logprobs(reference):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(MODEL / "hf-tokenizer"))
    prompt_ids = tok(" ".join(PROMPTS))["input_ids"]
    engine = Engine(load_model(MODEL), tiny_config(memory_budget_bytes=4 * 2 ** 30, max_context_tokens=2048,
                                                   warmup_prompt_tokens=(16, 64, 128), warmup_max_tokens=64,
                                                   prefill_tokens_per_iteration=16))
    engine.warmup()
    await engine.start()
    try:
        _, fin = await collect(engine, request("scored", prompt_ids, max_tokens=1,
                                               controls=Controls(prompt_logprobs=2)))
    finally:
        await engine.stop(grace_s=0)
    with torch.inference_mode():
        dist = torch.log_softmax(reference(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    got = fin.prompt_logprobs
    assert [e.token_id for e in got] == prompt_ids and got[0].logprob == 0.0
    want = [dist[p - 1, prompt_ids[p]].item() for p in range(1, len(prompt_ids))]
    assert [e.logprob for e in got[1:]] == pytest.approx(want, abs=1e-4)
    assert [[a.token_id for a in e.top] for e in got[1:]] == [torch.topk(dist[p - 1], 2).indices.tolist()
                                                              for p in range(1, len(prompt_ids))]
