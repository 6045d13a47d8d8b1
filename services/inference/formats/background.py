"""The quality gate of `auto`'s ungated candidates, run beside the serving stage; then the switch.

A start that found candidates without a stored gate result serves at once with each preloaded as a
locked variant "auto-<format>" (bootstrap.py). Once the stage serves, `BackgroundGate.run` starts
`python -m services.inference.formats.startgate` (a child process at nice 19: a thread of the
stage's own process would slow its batching thread, torchthread.py says why), hands it the job,
shows its progress in the stage status ("serving; gating int8, gguf in the background 120/200"),
and reads its verdict. When the verdict is one of the locked variants, that variant is unlocked and
switched to (Engine.set_variant): requests already running finish on the format they started with,
and each reply names the format and variant that served it (its replay record and its trace), so a
replay of an answer served before the switch is "not comparable: engine.format differ". Any other
verdict, or a child that dies, leaves the stage serving what it serves.

Nice 19 shares out the CPU, not the memory bandwidth and the caches a decode step is bound by, so
while the child scores prompts and the engine has work (rows running, admitted or queued) the child
is stopped (SIGSTOP) and continued when the engine is idle. A stage that is never idle still
finishes its gate: after MAX_PAUSE_S stopped in a row, the child runs for RUN_S whatever the load
(so at about RUN_S / (MAX_PAUSE_S + RUN_S) of its speed). Once every prompt is scored the child times
the formats (selection.choose_auto) and is never stopped: a stop would be counted into a format's time.
The child arms SIGKILL for the stage's death (shared/parentdeath.py), which a stopped process obeys.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from services.inference.engine.core import Engine
from services.inference.engine.variants import Switch
from services.inference.formats.startgate import GateJob, Verdict
from shared import stagestatus
from shared.config import ROOT_DIR

log = logging.getLogger(__name__)
MODULE = "services.inference.formats.startgate"
ACTOR = "auto quality gate"  # the SetVariant actor the switch is logged with
STOP_GRACE_S = 5.0
POLL_S = 0.05       # how often the engine's load is looked at while the child scores prompts
MAX_PAUSE_S = 20.0  # the longest the child stays stopped in a row
RUN_S = 2.0         # how long it then runs, loaded or not


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict | None  # None: the child ended without one (its exit code is logged)
    switch: Switch | None    # the switch made, when the verdict chose a candidate


class BackgroundGate:
    def __init__(self, job: GateJob, engine: Engine, candidates: Mapping[str, str],
                 board: stagestatus.StatusBoard = stagestatus.BOARD):
        """`candidates`: the engine's locked variants, name -> format (the formats `job` gates)."""
        self.job, self.engine, self.candidates, self.board = job, engine, candidates, board
        self.phase = f"serving; gating {', '.join(job.formats)} in the background"
        self._proc: asyncio.subprocess.Process | None = None
        self._scoring = True  # until the child reports its last prompt scored

    async def run(self) -> Outcome:
        self.board.phase(self.phase)
        try:
            verdict = await self._gate()
        finally:
            await self._stop_child()
            self.board.phase("serving")
        if verdict is None:
            return Outcome(None, None)
        return Outcome(verdict, await self._apply(verdict))

    async def _gate(self) -> Verdict | None:
        self._proc = proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", MODULE, str(os.getpid()), cwd=ROOT_DIR, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)  # stderr: the stage's own (its JSON log lines)
        proc.stdin.write(self.job.to_json().encode())
        await proc.stdin.drain()
        proc.stdin.close()
        yielding = asyncio.create_task(self._yield_to_requests(proc))
        try:
            verdict = await self._read(proc)
        finally:
            yielding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await yielding
        code = await proc.wait()
        if verdict is None:
            log.warning("background quality gate ended without a verdict; serving on",
                        extra={"exit_code": code, "formats": list(self.job.formats)})
        return verdict

    async def _read(self, proc: asyncio.subprocess.Process) -> Verdict | None:
        verdict = None
        async for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                log.warning("background quality gate: a line that is not JSON", extra={"line": raw[:200].decode(
                    errors="replace")})
                continue
            if "done" in line:
                if line["done"] <= 1:
                    self.board.phase(self.phase, total=line["total"])
                self.board.advance(line["done"])
                self._scoring = line["done"] < line["total"]
            elif "choice" in line:
                verdict = Verdict(line["choice"], line["reason"])
        return verdict

    def _engine_busy(self) -> bool:
        s = self.engine.stats()
        return bool(s.running_batch_size or s.pending_prefill or s.queue_depth)

    async def _yield_to_requests(self, proc: asyncio.subprocess.Process) -> None:
        """Stop the child while the engine has work and it scores prompts (the module's docstring);
        runs until cancelled, and leaves the child running."""
        clock = asyncio.get_running_loop().time
        stopped_at, run_until = None, 0.0
        try:
            while proc.returncode is None:
                now, busy = clock(), self._scoring and self._engine_busy()
                if stopped_at is None:
                    if busy and now >= run_until:
                        _signal(proc, signal.SIGSTOP)
                        stopped_at = now
                elif not busy or now - stopped_at >= MAX_PAUSE_S:
                    _signal(proc, signal.SIGCONT)
                    stopped_at, run_until = None, now + RUN_S if busy else 0.0
                await asyncio.sleep(POLL_S)
        finally:
            if stopped_at is not None:
                _signal(proc, signal.SIGCONT)

    async def _apply(self, verdict: Verdict) -> Switch | None:
        name = next((n for n, format in self.candidates.items() if format == verdict.choice), None)
        if name is None:
            log.info("background quality gate: keeping the served format", extra={
                "choice": verdict.choice, "reason": verdict.reason, "active": self.engine.active_variant()})
            return None
        self.engine.unlock_variant(name)
        switch = await self.engine.set_variant(name, ACTOR)
        log.info("background quality gate: switched to the format auto chose", extra={
            "variant": name, "format": verdict.choice, "previous": switch.previous, "reason": verdict.reason})
        return switch

    async def _stop_child(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        _signal(proc, signal.SIGCONT)  # a stopped child acts on the SIGTERM only once continued
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def _signal(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has just ended
        proc.send_signal(sig)
