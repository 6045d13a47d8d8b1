"""The transformers peers of bench/bench_serving.py, on the served model's Hugging Face weights (the
model cache's folder), greedy, each request to the length Keel's run produced (eos off):

  hf-static       model.generate on left-padded batches of 16, each batch as long as its longest request
  generate-batch  transformers' continuous batching (paged attention), one request per prompt, own
                  length, all handed over at once (generate-batch) or 16 in flight (generate-batch-16)
  hf-batch1       model.generate on one request at a time (batch 1)

Each peer runs in a fresh process (bench_serving.run_peer); `result` builds the caller's Result.
"""
from __future__ import annotations

import time

import torch

from shared.modelfile import source as model_source

STATIC_BATCH = 16


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM
    local = str(model_source().cache_dir)
    # bandit B615 does not apply: local dir.
    return AutoModelForCausalLM.from_pretrained(local, dtype=getattr(torch, dtype)).eval()  # nosec B615


@torch.inference_mode()
def hf_static(dtype: str, jobs, lengths: dict[int, int], result):
    model, res = load_hf(dtype), result()
    model.generate(torch.tensor([jobs[0].ids]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    t0 = time.perf_counter()
    for i in range(0, len(jobs), STATIC_BATCH):
        chunk = jobs[i:i + STATIC_BATCH]
        width, steps = max(len(j.ids) for j in chunk), max(lengths[j.index] for j in chunk)
        x = torch.tensor([[2] * (width - len(j.ids)) + j.ids for j in chunk])
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in chunk])
        model.generate(x, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       eos_token_id=None, pad_token_id=2)
        res.tokens.update({j.index: lengths[j.index] for j in chunk})  # a static batch runs to its longest
    res.wall = time.perf_counter() - t0
    return res


@torch.inference_mode()
def hf_continuous(dtype: str, jobs, lengths: dict[int, int], result, in_flight: int | None = None):
    """All requests handed over at once, or at most `in_flight` at a time (the next one added as one
    finishes, like that many closed-loop clients)."""
    from transformers import GenerationConfig
    model, res = load_hf(dtype), result()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(lengths.values()), eos_token_id=-1, pad_token_id=2)
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        t0, waiting, ids = time.perf_counter(), iter(jobs), {}

        def submit() -> None:
            job = next(waiting, None)
            if job is not None:
                ids[manager.add_request(job.ids, max_new_tokens=lengths[job.index], eos_token_id=-1)] = job.index
        for _ in range(in_flight or len(jobs)):
            submit()
        while len(res.tokens) < len(jobs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                res.tokens[ids[out.request_id]] = len(out.generated_tokens)
                submit()
        res.wall = time.perf_counter() - t0
    return res


@torch.inference_mode()
def hf_batch1(dtype: str, jobs, lengths: dict[int, int], result):
    """model.generate on one request at a time (batch 1), each as long as Keel's answer."""
    model, res = load_hf(dtype), result()
    model.generate(torch.tensor([jobs[0].ids]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    t0 = time.perf_counter()
    for job in jobs:
        steps = lengths[job.index]
        model.generate(torch.tensor([job.ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       eos_token_id=None, pad_token_id=2)
        res.tokens[job.index] = steps
    res.wall = time.perf_counter() - t0
    return res
