"""A call's deadline: the client's own (capped, less the answer margin), else a default that follows
the pace this gateway's answers have been served at (services/gateway/deadlines.py)."""
import random
import time

import pytest

from services.gateway.contract import Limits
from services.gateway.deadlines import MIN_PACE_TOKENS, Pace, deadline_from
from services.gateway.pipeline import Pipeline
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.values import Call
from testing.upstreams import FakeUpstreams, no_sleep
from tests.gateway.test_pipeline import ask


def test_the_gateway_answers_before_the_clients_deadline():
    """A status with a reason must reach the client before its own library's bare DEADLINE_EXCEEDED."""
    before = time.monotonic()
    deadline, default = deadline_from(10.0, Limits(answer_margin_ms=250))
    assert before + 9.75 - 0.05 <= deadline <= time.monotonic() + 9.75 and not default
    deadline, default = deadline_from(None, Limits(default_deadline_ms=60000))
    assert deadline >= before + 60.0 and default


def test_an_absurd_client_deadline_is_capped():
    """A 30-year (or 1e300 s) deadline is held to max_deadline_ms, never an overflow."""
    limits = Limits(max_deadline_ms=3_600_000, answer_margin_ms=0)
    for remaining in (1e9, 1e300, float("inf")):
        assert deadline_from(remaining, limits)[0] <= time.monotonic() + 3600.0


def test_the_default_follows_the_measured_pace_between_its_floor_and_the_cap():
    pace = Pace(Limits(default_deadline_ms=60000, deadline_pace_margin=3.0, max_deadline_ms=3_600_000))
    assert pace.default_s(1024) == 60.0  # nothing measured: the configured default
    pace.observe(20.0, 100)  # 0.2 s per token: a large model on a slow host
    assert pace.default_s(1024) == pytest.approx(3.0 * 1024 * 0.2)
    assert pace.default_s(16) == 60.0  # a short answer keeps the floor
    pace.observe(1000.0, 100)  # 10 s per token
    assert pace.default_s(1024) == 3600.0  # held to max_deadline_ms


def test_short_answers_do_not_set_the_pace():
    """An answer of a few tokens is mostly prefill and hops: counted, it would inflate the pace."""
    pace = Pace(Limits())
    pace.observe(5.0, MIN_PACE_TOKENS - 1)
    assert pace.s_per_token == 0.0
    pace.observe(1.6, MIN_PACE_TOKENS)
    assert pace.s_per_token == pytest.approx(0.1)
    pace.observe(3.2, MIN_PACE_TOKENS)  # the mean moves towards the newest answer, not to it
    assert 0.1 < pace.s_per_token < 0.2


class Timed(FakeUpstreams):
    """Records the time each generation is given."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.timeouts: list[float] = []

    async def generate(self, enc, ask, seed, timeout, md):
        self.timeouts.append(timeout)
        async for ev in super().generate(enc, ask, seed, timeout, md):
            yield ev


def pipeline(up) -> Pipeline:
    ex = RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1))
    return Pipeline(up, ex, Limits(max_context_tokens=2048, default_deadline_ms=60000), rng=random.Random(7))


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_call_without_a_deadline_gets_the_time_its_answer_needs_at_the_pace_measured(streamed):
    up = Timed(tokens=(5,) * MIN_PACE_TOKENS)
    p = pipeline(up)

    async def serve(call: Call):
        if streamed:
            return [x async for x in p.stream(ask(max_tokens=200), call)][-1]
        return await p.generate(ask(max_tokens=200), call)

    await serve(Call(time.monotonic() + 60.0, "t" * 32, default_deadline=True))
    assert up.timeouts[-1] <= 60.0 and p.pace.s_per_token > 0  # the answer was measured
    p.pace.s_per_token = 1.0  # as if answers took a second per token
    await serve(Call(time.monotonic() + 60.0, "t" * 32, default_deadline=True))
    assert 590.0 < up.timeouts[-1] <= 600.0  # 3 x 200 tokens x 1 s
    await serve(Call(time.monotonic() + 60.0, "t" * 32))  # the client's own deadline is kept
    assert up.timeouts[-1] <= 60.0
