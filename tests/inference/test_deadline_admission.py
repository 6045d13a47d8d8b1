"""Admission by deadline: a request that cannot finish within its deadline at the measured decode
rate is refused at once (RESOURCE_EXHAUSTED DEADLINE_UNREACHABLE, with a retry hint), instead of
holding a batch slot until the deadline cuts it. The decision is a pure function
(admission.deadline_refusal); the scheduler applies it on submission and to what waits in the
queue; the engine refuses before the request is ever queued."""
from __future__ import annotations

import dataclasses
import time

import pytest

from services.inference.engine.admission import MIN_PACE_STEPS, deadline_refusal
from services.inference.engine.stats import Pace
from shared.errors import Overloaded
from tests.inference.faults import FaultSpec, inject
from tests.inference.helpers import collect, prompt, request
from tests.inference.test_batching import wait_until
from tests.inference.test_schedule import scheduler, ticket

MEASURED = Pace(row_tokens_per_s=10.0, steps=MIN_PACE_STEPS)


def test_a_request_that_finishes_in_time_is_admitted():
    assert deadline_refusal(60.0, max_tokens=500, ahead_tokens=0, batch=4, pace=MEASURED) is None  # 50 s


def test_a_request_too_long_for_its_deadline_is_refused_with_the_estimate():
    err = deadline_refusal(60.0, max_tokens=1024, ahead_tokens=0, batch=4, pace=MEASURED)
    assert isinstance(err, Overloaded) and err.code == "RESOURCE_EXHAUSTED"
    assert err.reason == "DEADLINE_UNREACHABLE"
    assert err.metadata == {"estimated_ms": "102400", "remaining_ms": "60000", "row_tokens_per_s": "10.00",
                            "ahead_tokens": "0"}
    assert err.retry_after_ms == 50  # nothing to wait for: its own length is what does not fit


def test_the_queue_ahead_drains_over_the_running_batch():
    # 4,000 tokens ahead over 8 rows at 10 tokens/s each: 50 s of waiting, then 100 tokens: 10 s.
    assert deadline_refusal(60.0, max_tokens=100, ahead_tokens=4000, batch=8, pace=MEASURED) is None
    err = deadline_refusal(59.0, max_tokens=100, ahead_tokens=4000, batch=8, pace=MEASURED)
    assert err.metadata["estimated_ms"] == "60000" and err.retry_after_ms == 50_000  # the wait for a row


@pytest.mark.parametrize("remaining_s, pace, batch", [
    (None, MEASURED, 4),                                                  # no deadline
    (1.0, Pace(row_tokens_per_s=10.0, steps=MIN_PACE_STEPS - 1), 4),      # not enough measured yet
    (1.0, MEASURED, 0),                                                   # idle: measured under another load
])
def test_without_an_estimate_the_request_is_admitted(remaining_s, pace, batch):
    assert deadline_refusal(remaining_s, max_tokens=1024, ahead_tokens=0, batch=batch, pace=pace) is None


def test_the_pace_takes_its_first_step_whole_then_moves_a_fifth_of_the_way():
    pace = Pace().after(0.1)
    assert (pace.row_tokens_per_s, pace.steps) == (10.0, 1)
    pace = pace.after(0.05)
    assert (round(pace.row_tokens_per_s, 6), pace.steps) == (12.0, 2)


def test_queued_requests_are_refused_once_the_pace_shows_they_cannot_make_it():
    s = scheduler()
    queued = [ticket(f"q{i}", 4, max_tokens=100) for i in range(3)]
    for t in queued:
        # A burst: queued (the cap is 0 here) before anything was measured, each with 25 s left.
        t.req = dataclasses.replace(t.req, deadline=25.0)
        s.submit(t, cap=0, retry_after_ms=50, pace=Pace(), now=0.0)
    s.pending.append(ticket("running", 4, max_tokens=100))  # one row in the batch: batch 1
    # At 10 tokens/s per row: q0 needs 10 s, q1 10 s behind q0 = 20 s, q2 30 s > 25 s.
    ended, _ = s.expire(now=0.0, retry_after_ms=50, pace=MEASURED)
    assert [(t.req.request_id, e.reason) for t, e in ended] == [("q2", "DEADLINE_UNREACHABLE")]
    assert [t.req.request_id for t in s.admission.queue] == ["q0", "q1"]


@pytest.mark.parametrize("max_queued, reason", [(0, "QUEUE_FULL"), (64, "DEADLINE_UNREACHABLE")])
def test_a_request_that_could_not_even_wait_is_refused_for_the_full_queue_first(max_queued, reason):
    s = scheduler()
    s.admission.limits = dataclasses.replace(s.admission.limits, max_queued_requests=max_queued)
    s.pending.append(ticket("running", 4, max_tokens=100))  # the only slot (cap 1) is taken
    late = ticket("late", 4, max_tokens=100)
    late.req = dataclasses.replace(late.req, deadline=1.0)  # 100 tokens at 10 tokens/s: 10 s
    with pytest.raises(Overloaded) as exc:
        s.submit(late, cap=1, retry_after_ms=50, pace=MEASURED, now=0.0)
    assert exc.value.reason == reason and not s.admission.queue


@pytest.mark.asyncio
async def test_the_engine_refuses_at_once_what_cannot_finish_and_serves_what_can(make_engine):
    engine = await make_engine()
    # A long request whose every step sleeps 40 ms: while it runs, one row decodes at most 25 tokens/s.
    inject(engine)["long"] = FaultSpec(slow_step_ms=40)
    running = engine.generate(request("long", prompt(1), max_tokens=3000))
    await running.__anext__()
    assert await wait_until(lambda: engine.stats().pace.steps >= MIN_PACE_STEPS, timeout_s=60)
    admitted = engine.stats().counters.admitted

    # 1,000 tokens at <= 25 tokens/s need >= 40 s; the deadline leaves 5 s.
    hopeless = engine.generate(request("hopeless", prompt(2), max_tokens=1000, deadline=time.monotonic() + 5))
    with pytest.raises(Overloaded) as exc:
        await hopeless.__anext__()  # refused before it yields a single token
    assert exc.value.reason == "DEADLINE_UNREACHABLE" and exc.value.retry_after_ms >= 50
    assert float(exc.value.metadata["row_tokens_per_s"]) <= 25
    assert engine.stats().counters.admitted == admitted  # never took a batch slot
    assert await wait_until(lambda: engine.stats().counters.failed.get("DEADLINE_UNREACHABLE") == 1)

    # 4 tokens with a minute to spare: served, beside the long one.
    tokens, fin = await collect(engine, request("quick", prompt(3), max_tokens=4, deadline=time.monotonic() + 60))
    assert len(tokens) == 4 and fin.finish_reason == "length"
    await running.aclose()
