"""No rejected input is lost on the way to the quarantine: when the validator cannot take it within
the call's deadline (slow, unreachable), the gateway spills it to disk before it answers the
rejection and sends it again until the validator has it; with Redis really stopped as well, the
record reaches the stream once Redis is back."""
from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest
import redis

from services.gateway.contract import Ask, Limits
from services.gateway.pipeline import Pipeline
from services.gateway.rejects import RejectSpill, RejectSpillConfig, sender
from services.gateway.retry import RetryConfig, RetryExecutor
from services.gateway.values import Call
from services.validator.core import ValidatorCore
from services.validator.output_pipeline import PipelineConfig
from services.validator.quarantine import QuarantineConfig
from services.validator.records import QuarantineRecord
from shared import errors
from testing.upstreams import FakeUpstreams, no_sleep
from tests.validator.conftest import RedisServer

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 30  # only bounds a test that would otherwise wait forever
TRACE = "ab" * 16
EMPTY = Ask(messages=(), max_tokens=8)  # refused by the gateway itself: EMPTY_PROMPT


class SlowValidator(FakeUpstreams):
    """Takes no rejected input before ``ready`` is set: a call waits for it until its timeout
    runs out, then fails as the gateway's pool would fail it (DEADLINE_EXCEEDED)."""

    def __init__(self):
        super().__init__()
        self.ready = asyncio.Event()

    async def validate_input(self, payload, source, domain, timeout, md, rejected=None):
        if rejected is not None and not self.ready.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self.ready.wait()
            except TimeoutError:
                raise errors.DeadlineExpired("validator too slow", reason="DEADLINE_EXCEEDED") from None
        return await super().validate_input(payload, source, domain, timeout, md, rejected)


class CoreValidator(FakeUpstreams):
    """The real validator core behind the call (its quarantine on a real Redis); unreachable
    while ``down``."""

    def __init__(self, core: ValidatorCore):
        super().__init__()
        self.core, self.down = core, True

    async def validate_input(self, payload, source, domain, timeout, md, rejected=None):
        if self.down:
            raise errors.NotReady("validator unreachable", reason=errors.CONNECTION_LOST)
        await asyncio.to_thread(self.core.quarantine_rejected, json.dumps(payload), source=source, domain=domain,
                                trace_id=TRACE, reason=rejected.reason, message=rejected.message)


def gateway(up, spill: RejectSpill) -> Pipeline:
    ex = RetryExecutor(RetryConfig(), sleep=no_sleep, rng=random.Random(1))
    return Pipeline(up, ex, Limits(max_context_tokens=2048), rng=random.Random(7), spill_rejected=spill.put)


async def until(condition) -> None:
    end = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < end, "gave up waiting"
        await asyncio.sleep(0.01)


async def refuse(pipe: Pipeline, deadline_s: float) -> errors.InvalidInput:
    with pytest.raises(errors.InvalidInput) as exc:
        await pipe.generate(EMPTY, Call(time.monotonic() + deadline_s, TRACE))
    return exc.value


@pytest.fixture
def spill_cfg(tmp_path) -> RejectSpillConfig:
    return RejectSpillConfig(spill_path=str(tmp_path / "rejected.spill"), retry_interval_s=0.05)


@pytest.mark.asyncio
async def test_a_rejection_the_slow_validator_misses_is_spilled_first_and_sent_later(spill_cfg):
    up = SlowValidator()
    heard: list[int] = []  # what the gateway's backlog gauge is set to
    spill = RejectSpill(spill_cfg, sender(up.validate_input), heard.append)
    spill.start()
    try:
        err = await refuse(gateway(up, spill), deadline_s=0.05)
        # Answered with the gateway's own rejection, the input already on disk, not yet quarantined.
        assert err.reason == "EMPTY_PROMPT" and up.quarantined == []
        assert spill.backlog() == 1
        [line] = Path(spill_cfg.spill_path).read_text().splitlines()
        assert json.loads(line) | {"payload": None} == {"payload": None, "source": "default", "domain": "default",
                                                         "reason": "EMPTY_PROMPT", "message": err.message,
                                                         "trace_id": TRACE}
        assert heard[-1] == 1
        up.ready.set()
        await until(lambda: spill.backlog() == 0)
        assert up.quarantined == [("EMPTY_PROMPT", json.loads(line)["payload"])]
        await until(lambda: heard[-1] == 0)  # the gauge follows the backlog down
    finally:
        await spill.close()


@pytest.mark.asyncio
async def test_a_spilled_rejection_outlives_the_gateway_process(spill_cfg):
    up = SlowValidator()
    first = RejectSpill(spill_cfg, sender(up.validate_input))
    first.start()
    await refuse(gateway(up, first), deadline_s=0.05)
    await first.close()                       # stops with its backlog on disk
    up.ready.set()
    second = RejectSpill(spill_cfg, sender(up.validate_input))
    second.start()                            # the restarted worker claims the same slot
    try:
        await until(lambda: second.backlog() == 0)
        assert [r for r, _ in up.quarantined] == ["EMPTY_PROMPT"]
    finally:
        await second.close()


@pytest.fixture
def redis_server(tmp_path):
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, persistent=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def core(tmp_path, redis_server):
    cfg = QuarantineConfig(redis_url=redis_server.url, spill_path=tmp_path / "q.spill", probe_interval_s=0.05)
    core = ValidatorCore.build(ROOT / "config" / "contracts",
                               PipelineConfig.load(ROOT / "config" / "validator" / "pipeline.yaml"), cfg)
    core.start()
    yield core
    core.close()


@pytest.mark.asyncio
async def test_with_the_validator_down_and_redis_stopped_the_rejection_reaches_the_stream(
        spill_cfg, core, redis_server):
    redis_server.stop()                       # the redis-server process exits
    up = CoreValidator(core)
    spill = RejectSpill(spill_cfg, sender(up.validate_input))
    spill.start()
    try:
        err = await refuse(gateway(up, spill), deadline_s=5)
        assert err.reason == "EMPTY_PROMPT" and spill.backlog() == 1
        up.down = False                       # the validator is back, Redis still stopped:
        await until(lambda: spill.backlog() == 0)
        assert core.quarantine.backlog() == 1  # ... it took the record into its own spill
        redis_server.start()
        assert await asyncio.to_thread(core.quarantine.wait_drained, HANG_GUARD_S)
    finally:
        await spill.close()
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        [record] = [QuarantineRecord.from_fields(f) for _, f in client.xrange("keel:quarantine")]
    finally:
        client.close()
    assert (record.reason, record.rule, record.trace_id) == ("EMPTY_PROMPT", "gateway_limits", TRACE)
