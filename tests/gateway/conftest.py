"""Fakes for the gateway core tests: a manual clock whose sleep advances it, a scripted upstream."""
from __future__ import annotations

import pytest


class FakeClock:
    """Monotonic seconds that move only when told to, or when something sleeps on it."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ScriptedUpstream:
    """An attempt_fn that plays a script: each step is an exception to raise or a value to return.

    ``latency_s`` is how far each attempt moves the clock. Records (timeout, metadata) per call
    in ``calls`` and the clock reading at which each call began in ``starts``.
    """

    def __init__(self, clock: FakeClock, script, latency_s: float = 0.0):
        self.clock = clock
        self.script = list(script)
        self.latency_s = latency_s
        self.calls: list[tuple[float, dict]] = []
        self.starts: list[float] = []

    async def __call__(self, timeout_s: float, extra_metadata: dict):
        self.calls.append((timeout_s, dict(extra_metadata)))
        self.starts.append(self.clock.now)
        if not self.script:
            raise AssertionError("the executor made more attempts than the script has steps")
        step = self.script.pop(0)
        self.clock.advance(self.latency_s)
        if isinstance(step, BaseException):
            raise step
        return step


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def scripted(clock):
    """Factory: scripted(steps, latency_s=0.0) -> ScriptedUpstream on the test's clock."""
    return lambda steps, latency_s=0.0: ScriptedUpstream(clock, steps, latency_s)


@pytest.fixture(scope="session")
def fake_types():
    """The fake classes themselves, for tests (hypothesis) that need a fresh pair per example."""
    return FakeClock, ScriptedUpstream
