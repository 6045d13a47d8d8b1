"""The KV block pool: block tables, batched decode attention, block reservation and release."""
from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference.engine.admission import Admission, QueueLimits, Ticket
from services.inference.engine.memory import MemoryModel
from services.inference.model.forward import LlamaRunner
from services.inference.model.kvpool import PAD_BLOCK, KvPool, PoolExhausted
from services.inference.model.loader import convert_model
from shared.errors import NumericalInstability
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, prompt, read_cache, request, write_cache


def small_pool(blocks: int = 6) -> KvPool:
    return KvPool(n_layers=2, kv_heads=2, head_dim=4, block_tokens=4, blocks=blocks, dtype=torch.float32,
                  device=torch.device("cpu"))


def test_blocks_are_lent_zeroed_and_come_back():
    pool = small_pool()
    a = pool.allocate(9)                       # 3 blocks of 4 positions
    assert len(a.blocks) == 3 and a.capacity == 12 and pool.free_blocks == 3 and PAD_BLOCK not in a.blocks
    write_cache(a, 0, torch.full((2, 2, 12, 4), float("nan")), torch.full((2, 2, 12, 4), float("nan")))
    a.release()
    a.release()                                # idempotent
    assert pool.free_blocks == 6
    b = pool.allocate(12)                      # the same blocks, lowest id first, zeroed again
    keys, values = read_cache(b, 0, 12)
    assert keys.abs().sum() == 0 and values.abs().sum() == 0
    with pytest.raises(PoolExhausted):
        pool.allocate(13)
    del b                                      # a dropped cache gives its blocks back too
    assert pool.free_blocks == 6
    assert pool.keys[:, :, PAD_BLOCK].abs().sum() == 0 and pool.values[:, :, PAD_BLOCK].abs().sum() == 0


def test_write_and_read_address_positions_across_blocks():
    pool = small_pool()
    cache = pool.allocate(10)
    keys = torch.arange(2 * 2 * 7 * 4, dtype=torch.float32).view(2, 2, 7, 4)
    write_cache(cache, 3, keys, -keys)               # positions 3..9 span all three blocks
    got_k, got_v = read_cache(cache, 3, 7)
    assert torch.equal(got_k, keys) and torch.equal(got_v, -keys)
    assert read_cache(cache, 0, 3)[0].abs().sum() == 0


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_a_row_alone_equals_the_row_in_batches_of_other_lengths(tiny, fmt, threads):
    """Alone, a short row's decode attention spans one block; next to a 300-token row its block table is
    padded to 19-20 blocks, next to a 40-token row to 3. Its logits stay bitwise equal."""
    model = tiny if fmt == "float32" else convert_model(tiny, fmt)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_alone_equals_batched(LlamaRunner(model))
    finally:
        torch.set_num_threads(old)


def _check_alone_equals_batched(runner: LlamaRunner) -> None:
    assert runner.calibrate_invariant_sizes(16)
    short = prompt(1, 5)
    mates = {"long": [prompt(2, 300)], "medium": [prompt(3, 40)], "mixed": [prompt(4, 60), prompt(5, 130),
                                                                             prompt(6, 9)]}

    def run(prompts, row):
        caches = [runner.new_cache(len(p) + 8) for p in prompts]
        cur = [int(runner.prefill(p, c).argmax()) for p, c in zip(prompts, caches)]
        steps = []
        for _ in range(6):
            logits = runner.decode(cur, caches)
            steps.append(logits[row])
            cur = logits.argmax(-1).tolist()
        return steps

    alone = run([short], 0)
    for name, others in mates.items():
        for row in (0, len(others)):
            together = run(others[:row] + [short] + others[row:], row)
            assert all(torch.equal(a, t) for a, t in zip(alone, together)), (name, row)


def _ticket(blocks: int, cost: int = 1) -> Ticket:
    return Ticket(request(f"t{blocks}", prompt(0, 4)), 0, cost, None, None, blocks=blocks)


def test_admission_waits_for_blocks_even_when_bytes_fit():
    memory = MemoryModel(static_bytes=0, fixed_bytes=0, activation_bytes_per_token=0, decode_bytes_per_token=1,
                         kv_bytes_per_token=1, block_tokens=4)
    admission = Admission(memory, 10**9, QueueLimits(8, 10**6, 30_000), pool_blocks=10)
    running, waiting = _ticket(7), _ticket(4)
    admission.reserve(running)
    admission.enqueue(waiting, 100)
    assert not admission.fits_now(waiting) and admission.pop_ready(4) == []
    admission.release(running)
    assert admission.pop_ready(4) == [waiting] and admission.reserved_blocks == 4


@pytest.mark.asyncio
async def test_finished_and_cancelled_rows_give_their_blocks_back(make_engine):
    engine = await make_engine()
    pool = engine.primary_runner.pool
    assert pool.blocks == engine.memory.pool_blocks(engine.config.memory_budget_bytes)
    await asyncio.gather(*(collect(engine, request(f"f{i}", prompt(i, 20 + 30 * i), max_tokens=5)) for i in range(4)))
    assert pool.free_blocks == pool.blocks
    stream = engine.generate(request("c", prompt(9, 50), max_tokens=500))
    await stream.__anext__()
    assert pool.free_blocks == pool.blocks - engine.memory.cache_positions(550) // pool.block_tokens
    await stream.aclose()
    for _ in range(500):
        if engine.stats().running_batch_size == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.free_blocks == pool.blocks


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_request_waits_for_blocks_and_the_running_row_is_not_failed(make_engine, tiny_memory):
    """A budget for one long request: a second one queues until the first is done, then runs."""
    budget = tiny_memory.static_bytes + int(1.5 * tiny_memory.request_bytes(100, 400))
    engine = await make_engine(memory_budget_bytes=budget)
    pool = engine.primary_runner.pool
    first = asyncio.ensure_future(collect(engine, request("a", prompt(1, 100), max_tokens=400)))
    while engine.stats().running_batch_size == 0:
        await asyncio.sleep(0.01)
    second = asyncio.ensure_future(collect(engine, request("b", prompt(2, 100), max_tokens=400)))
    while engine.stats().queue_depth == 0 and not first.done():
        await asyncio.sleep(0.001)
    assert engine.stats().queue_depth == 1 or first.done()
    (a, _), (b, _) = await first, await second
    assert len(a) == len(b) == 400 and pool.free_blocks == pool.blocks


@pytest.mark.asyncio
async def test_blocks_poisoned_by_a_nan_row_serve_the_next_request_clean(make_engine):
    """A row whose hidden state turned NaN wrote NaN keys and values into its blocks; the next request
    gets the same blocks (lowest first), zeroed, and answers as on a fresh engine."""
    engine = await make_engine()
    fresh = await make_engine()
    inject(engine)["nan"] = FaultSpec(nan_at_step=8)
    with pytest.raises(NumericalInstability):  # its token 8 goes to position 12, in its first block
        await collect(engine, request("nan", prompt(3, 5), max_tokens=12))
    pool = engine.primary_runner.pool
    assert pool.free_blocks == pool.blocks
    assert pool.keys[:, :, PAD_BLOCK].abs().sum() == 0 and pool.values[:, :, PAD_BLOCK].abs().sum() == 0
    assert not torch.isfinite(pool.values[:, :, 1]).all()  # the poisoned row's first block, as it left it
    clean = request("clean", prompt(4, 5), max_tokens=10, temperature=0.8, seed=7)  # block 1 again
    got, _ = await collect(engine, clean)
    want, _ = await collect(fresh, clean)
    assert [(t.token_id, t.logprob) for t in got] == [(t.token_id, t.logprob) for t in want]


def test_the_memory_model_charges_caches_in_whole_blocks():
    model = MemoryModel(static_bytes=1000, fixed_bytes=500, activation_bytes_per_token=30,
                        decode_bytes_per_token=10, kv_bytes_per_token=10, block_tokens=16)
    assert model.request_bytes(10, 7) == 10 * 32 + 500            # 17 positions take 2 blocks
    budget = 1000 + 10 * 16 * 20 + 500
    assert model.pool_blocks(budget) == 23                          # (budget - static) // block bytes
    n = model.max_total_tokens(budget)
    assert model.static_bytes + model.request_bytes(n, 0) <= budget < model.static_bytes + model.request_bytes(n + 1, 0)
    assert model.static_bytes + model.request_bytes(1, n - 1) <= budget


def test_the_pool_is_not_written_at_allocation_in_deterministic_mode():
    """Deterministic mode NaN-fills torch.empty; the pool must stay unwritten (pages not resident)
    except for the padding block, which is zero."""
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        # 134 MB per tensor: beyond malloc's largest mmap threshold (32 MB), so fresh pages, never
        # memory an earlier test wrote
        pool = KvPool(n_layers=2, kv_heads=2, head_dim=64, block_tokens=16, blocks=8192, dtype=torch.float32,
                      device=torch.device("cpu"))
        assert torch.utils.deterministic.fill_uninitialized_memory  # the flag is restored
    finally:
        torch.use_deterministic_algorithms(old)
    lent = pool.keys[:, :, 1:]
    assert not lent.isnan().all()                # a NaN fill would have written every position
    assert pool.keys[:, :, PAD_BLOCK].abs().sum() == 0
