"""Continuous batching through the Engine: streaming, joining, leaving, cancellation, invariance."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import pytest

from services.inference.engine.admission import Ticket
from services.inference.engine.core import Engine
from services.inference.engine.inbox import SetVariant, Stop, Submit
from shared.errors import DeadlineExpired, InvalidInput, NotReady
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, ids, prompt, request, tiny_config


async def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return predicate()


@pytest.mark.asyncio
async def test_stream_indices_usage_and_length_finish(make_engine):
    engine = await make_engine()
    tokens, fin = await collect(engine, request("a", prompt(1, 9), max_tokens=7))
    assert [t.index for t in tokens] == list(range(7))
    assert fin.finish_reason == "length" and fin.prompt_tokens == 9 and fin.completion_tokens == 7
    assert fin.format == "float32" and fin.breaker_level == 0
    assert all(t.logprob <= 0 and t.entropy >= 0 for t in tokens)
    assert fin.ttft_ms >= fin.queue_ms >= 0


@pytest.mark.asyncio
async def test_stop_token_ends_without_being_streamed(make_engine):
    engine = await make_engine()
    ref, _ = await collect(engine, request("a", prompt(2), max_tokens=8))
    stop_at = ids(ref)[3]
    first = ids(ref).index(stop_at)
    tokens, fin = await collect(engine, request("b", prompt(2), max_tokens=8, stop_token_ids=(stop_at,)))
    assert ids(tokens) == ids(ref)[:first]
    assert fin.finish_reason == "stop" and fin.completion_tokens == first


@pytest.mark.asyncio
async def test_eos_from_config_stops(make_engine):
    probe = await make_engine()
    ref, _ = await collect(probe, request("a", prompt(3), max_tokens=6))
    engine = await make_engine(eos_token_ids=(ids(ref)[2],))
    tokens, fin = await collect(engine, request("b", prompt(3), max_tokens=6))
    assert fin.finish_reason == "stop" and ids(tokens) == ids(ref)[:ids(ref).index(ids(ref)[2])]


@pytest.mark.asyncio
async def test_greedy_alone_equals_greedy_in_a_batch(make_engine):
    engine = await make_engine()
    reqs = [request(f"r{i}", prompt(i, 4 + 3 * i), max_tokens=12) for i in range(8)]
    alone = [await collect(engine, r) for r in reqs]
    together = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for (a, _), (b, _) in zip(alone, together):
        assert ids(a) == ids(b)
        assert [t.logprob for t in a] == [t.logprob for t in b]  # bitwise, not approximately


@pytest.mark.asyncio
async def test_newcomer_joins_between_steps_and_finished_rows_leave(make_engine):
    engine = await make_engine()
    ref_b, _ = await collect(engine, request("ref", prompt(5), max_tokens=5))
    b_tokens, b_batch_sizes, after, long_tokens = [], [], None, 0
    async for item in engine.generate(request("long", prompt(4), max_tokens=120)):
        long_tokens += 1
        if getattr(item, "index", None) == 3:
            async for b_item in engine.generate(request("b", prompt(5), max_tokens=5)):
                b_tokens.append(b_item)
                b_batch_sizes.append(engine.stats().running_batch_size)
            after = engine.stats().running_batch_size
    assert ids(b_tokens[:-1]) == ids(ref_b)   # joining mid-way changes nothing for b
    assert 2 in b_batch_sizes                  # b decoded alongside "long"
    assert after == 1                          # and left the batch as soon as it finished
    assert long_tokens == 121                  # while "long" went on to the end
    assert engine.stats().counters.completed == 3


@pytest.mark.asyncio
async def test_aclose_removes_the_row_and_frees_its_reservation(make_engine):
    engine = await make_engine()
    static = engine.stats().memory.static_bytes
    stream = engine.generate(request("a", prompt(6), max_tokens=3000))
    await stream.__anext__()
    assert engine.stats().memory.predicted_bytes > static
    await stream.aclose()
    assert await wait_until(lambda: engine.stats().running_batch_size == 0)
    assert engine.stats().memory.predicted_bytes == static
    assert engine.stats().counters.completed == 0


@pytest.mark.asyncio
async def test_cancelled_task_frees_its_row(make_engine):
    engine = await make_engine()
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(request("a", prompt(7), max_tokens=3000)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until(lambda: engine.stats().running_batch_size == 0)
    assert engine.stats().memory.predicted_bytes == engine.stats().memory.static_bytes


@pytest.mark.asyncio
async def test_a_consumer_that_stops_reading_frees_its_row(make_engine):
    """Cancellation is the consumer closing its stream (the servicer does when the client cancels)."""
    engine = await make_engine()
    stream = engine.generate(request("x", prompt(8), max_tokens=3000))
    await stream.__anext__()
    await stream.__anext__()
    assert engine.stats().running_batch_size == 1
    await stream.aclose()
    assert await wait_until(lambda: engine.stats().running_batch_size == 0)


@pytest.mark.asyncio
async def test_deadline_expires_mid_stream_and_counts_as_timeout(make_engine):
    engine = await make_engine()
    inject(engine)["d"] = FaultSpec(slow_step_ms=40)
    req = request("d", prompt(9), max_tokens=50, deadline=time.monotonic() + 0.15)
    got = []
    with pytest.raises(DeadlineExpired) as e:
        async for item in engine.generate(req):
            got.append(item)
    assert 0 < len(got) < 50 and e.value.reason == "DEADLINE_EXPIRED"
    assert engine.stats().breaker["timeout"].total_failures == 1


@pytest.mark.asyncio
async def test_past_deadline_is_refused_up_front(make_engine):
    engine = await make_engine()
    with pytest.raises(DeadlineExpired):
        await collect(engine, request("d", prompt(1), deadline=time.monotonic() - 1))


@pytest.mark.asyncio
async def test_duplicate_request_id_in_flight_is_rejected(make_engine):
    engine = await make_engine()
    stream = engine.generate(request("dup", prompt(1), max_tokens=3000))
    await stream.__anext__()
    with pytest.raises(InvalidInput) as e:
        await collect(engine, request("dup", prompt(2)))
    assert e.value.reason == "DUPLICATE_REQUEST_ID"
    await stream.aclose()
    tokens, _ = await collect(engine, request("dup", prompt(2), max_tokens=2))  # free again afterwards
    assert len(tokens) == 2


@pytest.mark.asyncio
async def test_invariance_padding_can_be_switched_off(make_engine):
    on = await make_engine()
    off = await make_engine(batch_invariant=False)
    assert 16 in on.stats().invariant_batch_sizes["float32"]
    assert off.stats().invariant_batch_sizes["float32"] == ()
    tokens, _ = await collect(off, request("a", prompt(1), max_tokens=5))
    assert len(tokens) == 5


@pytest.mark.asyncio
async def test_commands_that_race_the_stop_get_its_error(tiny):
    """Stop, then a submission and a variant switch already in the inbox: the loop ends, and both
    hear the stop's error instead of being dropped."""
    engine = Engine(tiny, tiny_config())
    engine.warmup()
    loop = engine._loop
    ticket = Ticket(request("late", prompt(1), max_tokens=2), 0, 0, asyncio.get_running_loop(), asyncio.Queue())
    switched: Future = Future()
    stop = NotReady("the engine is stopping", reason="SHUTTING_DOWN")
    for command in (Stop(stop), Submit(ticket), SetVariant("primary", "test", switched)):
        loop.inbox.put(command)
    loop.start()
    loop.shutdown(stop)  # Stop again; returns once the loop has ended
    assert await asyncio.wait_for(ticket.events.get(), 5) is stop
    assert switched.exception(timeout=5) is stop
