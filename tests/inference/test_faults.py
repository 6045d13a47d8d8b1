"""Numerical guard and OOM recovery, driven by injected faults in a batch of 8."""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from services.inference.engine.breaker import BreakerConfig, TripRule
from services.inference.engine.oom import is_oom
from shared.errors import NumericalInstability, Overloaded
from tests.inference.faults import FaultSpec, RowFaults, inject
from tests.inference.helpers import collect, ids, prompt, request

N_TOKENS = 10


def batch(faults: dict[str, FaultSpec] | None = None, faulty: int | None = None, spec: FaultSpec | None = None):
    reqs = [request(f"{'f' if spec else 'c'}{i}", prompt(i, 5 + 2 * i), max_tokens=N_TOKENS, fingerprint=f"fp-{i}")
            for i in range(8)]
    if spec is not None:
        faults[reqs[faulty].request_id] = spec
    return reqs


async def run_all(engine, reqs):
    async def one(r):
        got = []
        try:
            async for item in engine.generate(r):
                got.append(item)
        except Exception as exc:  # noqa: BLE001 - the test inspects which rows failed and how
            return got, exc
        return got, None
    return await asyncio.gather(*(one(r) for r in reqs))


@pytest.mark.asyncio
async def test_nan_in_one_row_fails_it_alone(make_engine, caplog):
    engine = await make_engine()
    faults = inject(engine)
    clean = await run_all(engine, batch())
    caplog.set_level(logging.WARNING, logger="services.inference.engine.output")
    faulty = await run_all(engine, batch(faults, 3, FaultSpec(nan_at_step=4)))
    for i, ((ref, _), (got, err)) in enumerate(zip(clean, faulty)):
        if i == 3:
            assert isinstance(err, NumericalInstability)
            assert err.metadata["fingerprint"] == "fp-3" and err.metadata["step"] == "4"
            assert [t.token_id for t in got] == [t.token_id for t in ref[:4]]  # tokens before the fault
        else:
            assert err is None and ids(got[:-1]) == ids(ref[:-1])
    record = next(r for r in caplog.records if getattr(r, "fingerprint", None) == "fp-3")
    assert record.batch_size == 8 and record.step == 4       # it really was inside the batch of 8
    stats = engine.stats()
    assert stats.counters.numerical_faults == 1
    assert stats.breaker["numerical_instability"].total_failures == 1
    assert stats.running_batch_size == 0 and stats.memory.predicted_bytes == stats.memory.static_bytes


@pytest.mark.asyncio
async def test_nan_at_prefill_fails_before_any_token(make_engine):
    engine = await make_engine()
    faults = inject(engine)
    faults["n"] = FaultSpec(nan_at_step=0)
    got, err = (await run_all(engine, [request("n", prompt(1))]))[0]
    assert got == [] and isinstance(err, NumericalInstability)


@pytest.mark.asyncio
async def test_negative_fault_steps_mean_never(make_engine):
    engine = await make_engine()
    faults = inject(engine)
    faults["x"] = FaultSpec(nan_at_step=-1, oom_at_step=-1)
    tokens, fin = await collect(engine, request("x", prompt(1), max_tokens=4))
    assert len(tokens) == 4 and engine.stats().counters.oom_events == 0


@pytest.mark.asyncio
async def test_one_oom_halves_the_batch_and_everyone_finishes(make_engine):
    engine = await make_engine(oom_backoff_steps=1000)
    faults = inject(engine)
    clean = await run_all(engine, batch())
    faulty = await run_all(engine, batch(faults, 2, FaultSpec(oom_at_step=3)))
    for (ref, _), (got, err) in zip(clean, faulty):
        assert err is None and ids(got[:-1]) == ids(ref[:-1])
    stats = engine.stats()
    assert stats.counters.oom_events == 1 and stats.counters.oom_recoveries == 1
    assert stats.batch_cap == 4                       # the cap stays halved until the backoff passes
    assert stats.breaker["oom"].total_failures == 1


@pytest.mark.asyncio
async def test_batch_cap_recovers_after_backoff(make_engine):
    engine = await make_engine(oom_backoff_steps=3)
    faults = inject(engine)
    await run_all(engine, batch(faults, 2, FaultSpec(oom_at_step=1)))
    assert engine.stats().batch_cap == 16


@pytest.mark.asyncio
async def test_persistent_oom_fails_only_that_row_with_overloaded(make_engine):
    # Threshold 5: four OOMs must not trip level 1, whose logit clamp would change the other rows' tokens.
    breaker = BreakerConfig(oom=TripRule(60.0, 5))
    engine = await make_engine(breaker=breaker)
    faults = inject(engine)
    clean = await run_all(engine, batch())
    faulty = await run_all(engine, batch(faults, 2, FaultSpec(oom_at_step=3, oom_repeat=True)))
    for i, ((ref, _), (got, err)) in enumerate(zip(clean, faulty)):
        if i == 2:
            assert isinstance(err, Overloaded) and err.reason == "OUT_OF_MEMORY" and err.retry_after_ms > 0
            assert ids(got) == ids(ref[:3])
        else:
            assert err is None and ids(got[:-1]) == ids(ref[:-1])
    stats = engine.stats()
    assert stats.counters.oom_events == 4               # batches of 8, 4, 2, then 1
    assert stats.breaker["oom"].total_failures == 4 and stats.breaker["oom"].level == 0
    tokens, _ = await collect(engine, request("after", prompt(9), max_tokens=3))
    assert len(tokens) == 3                                   # the engine is still serving


@pytest.mark.asyncio
async def test_oom_in_prefill_fails_the_newcomer(make_engine):
    engine = await make_engine()
    faults = inject(engine)
    faults["o"] = FaultSpec(oom_at_step=0)
    got, err = (await run_all(engine, [request("o", prompt(1))]))[0]
    assert got == [] and isinstance(err, Overloaded) and err.reason == "OUT_OF_MEMORY"
    assert engine.stats().memory.predicted_bytes == engine.stats().memory.static_bytes


@pytest.mark.parametrize("exc,expected", [
    (torch.OutOfMemoryError("CUDA out of memory"), True),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), True),
    (MemoryError(), True),
    (RuntimeError("shape mismatch"), False),
    (ValueError("out of memory"), False),
])
def test_is_oom(exc, expected):
    assert is_oom(exc) is expected


def test_one_shot_oom_fires_once_and_repeat_keeps_firing():
    once = RowFaults(FaultSpec(oom_at_step=2))
    assert [once.take_oom(s) for s in (0, 1, 2, 2, 3)] == [False, False, True, False, False]
    again = RowFaults(FaultSpec(oom_at_step=2, oom_repeat=True))
    assert [again.take_oom(s) for s in (1, 2, 2, 3)] == [False, True, True, True]
