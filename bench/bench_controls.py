"""Cost of the generation controls per decode step, as ratios against plain rows in the same run.

    .venv/bin/python -m bench.bench_controls [--rounds 3] [--tokens 24] [--batch 16] [--tiny]

Each round runs the same batch of `--batch` requests (greedy, different prompts, eos off) three
ways, in turn: plain; every row constrained by a JSON Schema (llguidance computes each row's mask
in the step); every row with repetition/frequency/presence penalties and logprobs with 5
alternatives. The decode step time of a run is the time from the batch's second token to its last,
over the steps between (the prefill is left out). Ratios are of the fastest round of each (on a
shared machine the fastest is the least disturbed one), and the median over rounds of each round's
own ratio to the plain run just before it (less exposed to a slow drift of the host). The schema's
string needs more tokens than the run generates, so no constrained row ends early.

The same window is also timed in process CPU (all threads), which a busy hypervisor's stolen time
does not inflate. A last section times the controls' own work per step in process CPU time, away from the model:
sampling 16 rows from logits [16, V] plain, and with each kind's controls (the grammar's mask, the
penalties, logprobs and their bookkeeping), over `--tokens` steps; it adds that to the fastest
plain step for a ratio less exposed to other processes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from bench.lib.machine import machine_line
from services.inference.engine.controls import RowControls, logprobs, shape
from services.inference.engine.core import Engine, EngineConfig, GenerationRequest, TokenEvent
from services.inference.engine.grammar import Grammars, MaskExecutor, Vocabulary, version
from services.inference.engine.sampling import Draw, pick
from services.inference.model.loader import load_model
from shared.controls import Controls, ResponseFormat
from shared.modelfile import source as model_source
from testing.tiny import tiny_model

MODEL = model_source().cache_dir
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "minLength": 400},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
          "required": ["title", "year"], "additionalProperties": False}
KINDS = {
    "plain": Controls(),
    "json_schema": Controls(response_format=ResponseFormat("json_schema", json.dumps(SCHEMA))),
    "penalties+logprobs": Controls(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                                   logprobs=True, top_logprobs=5),
}


async def step_ms(engine: Engine, controls: Controls, batch: int, tokens: int, round_: int) -> tuple[float, float]:
    """Mean decode step of one batch run, second token to last over the steps between: wall ms and
    the process's CPU ms (every thread: the step loop's, torch's, llguidance's)."""
    stamps: dict[int, tuple[float, float]] = {}

    async def one(i: int) -> None:
        req = GenerationRequest(request_id=f"r{round_}-{i}-{id(controls)}", prompt_ids=[1 + (i * 7919 + j * 104729)
                                                                                        % 40000 for j in range(24)],
                                max_tokens=tokens, controls=controls)
        async for ev in engine.generate(req):
            if isinstance(ev, TokenEvent) and ev.index == 1:
                stamps.setdefault(1, (time.perf_counter(), time.process_time()))  # the first row's second token
            elif isinstance(ev, TokenEvent) and ev.index == tokens - 1:
                stamps[tokens - 1] = (time.perf_counter(), time.process_time())   # the last row's last token
    await asyncio.gather(*(one(i) for i in range(batch)))
    (w0, c0), (w1, c1) = stamps[1], stamps[tokens - 1]
    return (w1 - w0) / (tokens - 2) * 1e3, (c1 - c0) / (tokens - 2) * 1e3


async def controls_cpu_ms(vocab: Vocabulary, controls: Controls, batch: int, steps: int) -> float:
    """Process CPU ms per step to sample `batch` rows with `controls` (plain: no controls)."""
    grammars = Grammars(vocab)
    rows = [RowControls(controls, list(range(3, 27)), vocab, await grammars.matcher(controls.response_format)
                        if controls.response_format else None) for _ in range(batch)]
    logits = torch.randn(batch, vocab.size, generator=torch.Generator().manual_seed(0))
    plain = controls == Controls()
    masks = MaskExecutor(torch.get_num_threads())
    start = time.process_time()
    for step in range(steps):  # what OutputProcessor._sample does with the step's rows
        scores = logits if plain else shape(rows, logits, masks).scores
        picks = pick(logits, [Draw(0.0, 1.0, 0, i, 24 + step) for i in range(batch)], scores)
        if not plain:
            logprobs(rows, scores, [p.token_id for p in picks], [0.0] * batch)
            for row, p in zip(rows, picks):
                row.accept(p.token_id)
    grammars.close()
    return (time.process_time() - start) / steps * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (same vocabulary size)")
    args = ap.parse_args()
    model = tiny_model() if args.tiny else load_model(MODEL, "float32", "cpu")
    engine = Engine(model, EngineConfig(memory_budget_bytes=8 * 2 ** 30, max_batch_size=args.batch, eos_token_ids=(),
                                        max_queued_requests=1024, queue_timeout_ms=10 ** 7))
    engine.warmup()
    vocab = Vocabulary(MODEL / "hf-tokenizer" / "tokenizer.json", (2,))
    engine.install_vocabulary(vocab)
    await engine.start()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu_times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds + 1):  # round 0 warms up (and compiles the schema once)
        for name, controls in KINDS.items():
            ms, cpu_ms = await step_ms(engine, controls, args.batch, args.tokens, r)
            if r:
                times[name].append(ms)
                cpu_times[name].append(cpu_ms)
    await engine.stop(grace_s=1)
    cpu = {k: min([await controls_cpu_ms(vocab, c, args.batch, args.tokens) for _ in range(3)])
           for k, c in KINDS.items()}
    med = {k: min(v) for k, v in times.items()}
    print(f"model {'tiny' if args.tiny else MODEL}, batch {args.batch}, {args.tokens} tokens, {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}, {version()}")
    for name, ms in med.items():
        paired = statistics.median(x / p for x, p in zip(times[name], times["plain"]))
        print(f"  {name:<20} decode step fastest {ms:8.2f} ms  (rounds: {', '.join(f'{x:.2f}' for x in times[name])})"
              f"  ratio {ms / med['plain']:.3f}  median of per-round ratios {paired:.3f}")
    fastest_cpu = {k: min(v) for k, v in cpu_times.items()}
    print("the same steps in process CPU per step (a host's stolen time is not charged to the process):")
    for name, ms in fastest_cpu.items():
        print(f"  {name:<20} {ms:8.2f} ms  (rounds: {', '.join(f'{x:.1f}' for x in cpu_times[name])})"
              f"  ratio {ms / fastest_cpu['plain']:.3f}")
    print(f"sampling {args.batch} rows alone, process CPU per step (fastest of 3), added to the fastest plain step:")
    for name, ms in cpu.items():
        extra = ms - cpu["plain"]
        print(f"  {name:<20} {ms:7.2f} ms  (+{extra:.2f} ms)  ratio {(med['plain'] + extra) / med['plain']:.3f}")
    print(machine_line())


if __name__ == "__main__":
    asyncio.run(main())
