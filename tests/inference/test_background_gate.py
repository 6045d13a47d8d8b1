"""background.py: the gate of auto's ungated candidates runs in a child process while the stage
serves; its progress shows in the stage status; its verdict unlocks the winning candidate and
switches to it; any other outcome leaves the stage serving what it serves, and a stage that stops
stops the child. The child here is tests/inference/fake_startgate.py; test_gate_at_start.py runs the
real one on the tiny model."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging

import psutil
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry

from keel.inference.v1 import inference_pb2
from services.inference.engine.core import Engine
from services.inference.engine.variants import Switch
from services.inference.formats import background
from services.inference.formats.background import BackgroundGate
from services.inference.formats.selection import FormatsConfig
from services.inference.formats.startgate import GateJob, Verdict
from services.inference.servicer import InferenceServicer
from shared.errors import PreconditionFailed
from shared.metrics import metrics_for
from shared.stagestatus import StatusBoard
from tests.inference.helpers import collect, prompt, request, tiny_config

pytestmark = pytest.mark.slow

CANDIDATES = {"auto-int8": "int8"}
PHASE = "serving; gating int8 in the background"


class Recording(StatusBoard):
    """A board that keeps every (phase, done, total) it was moved to."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []

    def phase(self, name, total=0):
        super().phase(name, total)
        self.seen.append((name, 0, total))

    def advance(self, done):
        super().advance(done)
        s = self.snapshot()
        self.seen.append((s.phase, s.done, s.total))


def job() -> GateJob:
    return GateJob("unused", "0" * 64, ("int8",), FormatsConfig(), "cpu", 1, 4)


@pytest_asyncio.fixture
async def engine(tiny):
    e = Engine(tiny, tiny_config(variants=CANDIDATES), locked=CANDIDATES)
    e.warmup()
    await e.start()
    yield e
    await e.stop(grace_s=0)


@pytest.fixture
def child(monkeypatch):
    """child(action): what the fake child does (fake_startgate.py)."""
    monkeypatch.setattr(background, "MODULE", "tests.inference.fake_startgate")
    return lambda action: monkeypatch.setenv("FAKE_GATE", action if isinstance(action, str) else json.dumps(action))


def verdict(choice) -> dict:
    return {"choice": choice, "reason": f"auto: {choice} wins", "expect_formats": ["int8"]}


@pytest.mark.asyncio
async def test_a_candidate_is_refused_until_its_gate_passes_and_get_variant_marks_it(engine):
    servicer = InferenceServicer(engine, metrics_for("inference", CollectorRegistry()))
    shown = await servicer.GetVariant(inference_pb2.GetVariantRequest(), None)
    assert list(shown.locked) == ["auto-int8"] and dict(shown.variants)["auto-int8"] == "int8"
    with pytest.raises(PreconditionFailed) as err:
        await engine.set_variant("auto-int8", "operator")
    assert err.value.reason == "VARIANT_NOT_GATED" and engine.active_variant() == "primary"
    engine.unlock_variant("auto-int8")
    assert list((await servicer.GetVariant(inference_pb2.GetVariantRequest(), None)).locked) == []
    assert await engine.set_variant("auto-int8", "operator") == Switch("auto-int8", "primary")


@pytest.mark.asyncio
async def test_the_verdict_switches_to_its_candidate_and_the_status_shows_the_progress(engine, child):
    child(verdict("int8"))
    _, before = await collect(engine, request("before", prompt(1), max_tokens=4))
    board = Recording()
    outcome = await BackgroundGate(job(), engine, CANDIDATES, board).run()
    assert outcome.verdict == Verdict("int8", "auto: int8 wins")
    assert outcome.switch == Switch("auto-int8", "primary") and engine.active_variant() == "auto-int8"
    _, after = await collect(engine, request("after", prompt(1), max_tokens=4))
    assert (before.variant, before.format) == ("primary", "float32")
    assert (after.variant, after.format) == ("auto-int8", "int8")
    assert (PHASE, 3, 3) in board.seen and board.seen[0] == (PHASE, 0, 0)
    assert board.snapshot().phase == "serving"  # the gate is over


@pytest.mark.asyncio
@pytest.mark.parametrize("choice", ["float32", None])
async def test_a_verdict_naming_no_candidate_keeps_the_served_format(engine, child, choice, caplog):
    child(verdict(choice))
    with caplog.at_level(logging.INFO, logger=background.__name__):
        outcome = await BackgroundGate(job(), engine, CANDIDATES, Recording()).run()
    assert outcome.verdict.choice == choice and outcome.switch is None
    assert engine.active_variant() == "primary"
    assert "background quality gate: keeping the served format" in caplog.messages
    with pytest.raises(PreconditionFailed):  # still locked
        await engine.set_variant("auto-int8", "operator")


@pytest.mark.asyncio
async def test_a_child_that_dies_without_a_verdict_changes_nothing(engine, child, caplog):
    child("die")
    board = Recording()
    with caplog.at_level(logging.WARNING, logger=background.__name__):
        outcome = await BackgroundGate(job(), engine, CANDIDATES, board).run()
    assert outcome == background.Outcome(None, None) and engine.active_variant() == "primary"
    [record] = [r for r in caplog.records if r.getMessage().startswith("background quality gate ended")]
    assert record.exit_code == 3 and board.snapshot().phase == "serving"


def _fake_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "tests.inference.fake_startgate" in p.cmdline()]


@pytest.mark.asyncio
async def test_cancelling_the_gate_stops_its_child(engine, child):
    child("hang")
    board = Recording()
    task = asyncio.create_task(BackgroundGate(job(), engine, CANDIDATES, board).run())
    for _ in range(600):
        if (PHASE, 3, 3) in board.seen:
            break
        await asyncio.sleep(0.05)
    assert _fake_children()  # the child runs, waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _fake_children() and engine.active_variant() == "primary"


def _busy(engine, monkeypatch, running: list[bool]) -> None:
    """The engine reports a running row while running[0] is true."""
    real = engine.stats
    monkeypatch.setattr(engine, "stats", lambda: dataclasses.replace(real(), running_batch_size=int(running[0])))


async def _states(seconds: float) -> list[str]:
    """The fake child's process state, every 20 ms for `seconds`."""
    seen = []
    for _ in range(int(seconds / 0.02)):
        seen.extend(p.status() for p in _fake_children())
        await asyncio.sleep(0.02)
    return seen


async def _until(state: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if any(p.status() == state for p in _fake_children()):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the child never was {state}: {[p.status() for p in _fake_children()]}")


@pytest.mark.asyncio
async def test_the_child_is_stopped_while_the_engine_has_work_and_continued_when_idle(engine, child, monkeypatch):
    child("score")
    running = [True]
    _busy(engine, monkeypatch, running)
    task = asyncio.create_task(BackgroundGate(job(), engine, CANDIDATES, Recording()).run())
    await _until(psutil.STATUS_STOPPED)
    assert set(await _states(0.5)) == {psutil.STATUS_STOPPED}
    running[0] = False
    await _until(psutil.STATUS_SLEEPING)
    assert psutil.STATUS_STOPPED not in await _states(0.5)
    running[0] = True
    await _until(psutil.STATUS_STOPPED)
    task.cancel()  # a stopped child is ended too
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _fake_children()


@pytest.mark.asyncio
async def test_a_never_idle_engine_still_lets_the_child_run_between_pauses(engine, child, monkeypatch):
    child("score")
    monkeypatch.setattr(background, "MAX_PAUSE_S", 0.4)
    monkeypatch.setattr(background, "RUN_S", 0.3)
    _busy(engine, monkeypatch, [True])
    task = asyncio.create_task(BackgroundGate(job(), engine, CANDIDATES, Recording()).run())
    await _until(psutil.STATUS_STOPPED)
    seen = await _states(2.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert psutil.STATUS_STOPPED in seen and set(seen) - {psutil.STATUS_STOPPED}, collections.Counter(seen)


@pytest.mark.asyncio
async def test_once_every_gate_prompt_is_scored_the_child_is_not_stopped(engine, child, monkeypatch):
    """Its last phase times the formats: a stop would count into a format's time."""
    child("hang")  # 3/3 scored, then waits as if timing
    board = Recording()
    running = [False]  # idle while the child starts and scores: a busy engine would stop it for 20 s
    _busy(engine, monkeypatch, running)
    task = asyncio.create_task(BackgroundGate(job(), engine, CANDIDATES, board).run())
    for _ in range(1200):
        if (PHASE, 3, 3) in board.seen:
            break
        await asyncio.sleep(0.05)
    assert (PHASE, 3, 3) in board.seen, board.seen
    running[0] = True  # requests arrive once every gate prompt is scored
    seen = await _states(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen and psutil.STATUS_STOPPED not in seen, seen
