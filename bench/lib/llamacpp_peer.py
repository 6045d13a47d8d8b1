"""The llama.cpp peers of bench/bench_serving.py, on the same GGUF, 2 threads, greedy, each request to
the length Keel's run produced (eos off):

  llama-cpp          one request at a time through llama-cpp-python's `Llama.generate`
  llama-cpp-batched  llama.cpp's own batched decoding: up to 16 sequences, each its own seq_id in one
                     context, advanced together by one `llama_decode` per step (newcomers' prompts in
                     the same batch as the running sequences' tokens, as llama-server does), a finished
                     sequence's cache removed and its place given to the next request

Each peer runs in a fresh process (bench_serving.run_peer).
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from shared.modelfile import model_path

THREADS = 2


def single(jobs, lengths, result, clock):
    from llama_cpp import Llama
    llm, res = Llama(model_path=str(model_path()), n_threads=THREADS, n_ctx=2048, verbose=False, seed=0), result()
    t0 = time.perf_counter()
    for job in jobs:
        llm.reset()  # one independent request at a time: no prefix reuse across requests
        tick, n = clock(res), 0
        for _ in llm.generate(job.ids, top_k=1, top_p=1.0, temp=0.0):
            tick()
            n += 1
            if n == lengths[job.index]:
                break
        res.tokens[job.index] = n
    res.wall = time.perf_counter() - t0
    return res


def batched(jobs, lengths, result, clock, streams: int = 16):
    import llama_cpp

    per_seq = max(len(j.ids) + lengths[j.index] for j in jobs) + 8
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(model_path()).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_seq_max = per_seq * streams, streams
    cparams.n_batch = cparams.n_ubatch = max(512, streams + max(len(j.ids) for j in jobs) * streams)
    cparams.n_threads = cparams.n_threads_batch = THREADS
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    memory = llama_cpp.llama_get_memory(ctx)
    batch = llama_cpp.llama_batch_init(cparams.n_batch, 0, 1)
    res, waiting = result(), deque(jobs)
    free, live = list(range(streams)), {}  # seq id -> [job, next token, position, tokens made, clock]
    t0 = time.perf_counter()
    while waiting or live:
        n, rows = 0, []

        def add(token: int, pos: int, seq: int, want: bool) -> None:
            nonlocal n
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, pos, 1
            batch.seq_id[n][0], batch.logits[n] = seq, want
            if want:
                rows.append((n, seq))
            n += 1

        for seq, (job, token, pos, _, _) in live.items():
            add(token, pos, seq, True)
        while waiting and free:
            job, seq = waiting.popleft(), free.pop()
            for i, t in enumerate(job.ids):
                add(t, i, seq, i == len(job.ids) - 1)
            live[seq] = [job, None, len(job.ids), 0, clock(res)]
        batch.n_tokens = n
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for i, seq in rows:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            state = live[seq]
            if state[1] is not None:
                state[2] += 1  # the token fed this step is in the cache now
            state[1], state[3] = int(logits.argmax()), state[3] + 1
            state[4]()
            if state[3] == lengths[state[0].index]:
                res.tokens[state[0].index] = state[3]
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
                del live[seq]
                free.append(seq)
    res.wall = time.perf_counter() - t0
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return res
