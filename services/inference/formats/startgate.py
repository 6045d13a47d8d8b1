"""The quality gate `auto` runs for its candidates that have no stored result, while the stage serves.

With `formats.gate_at_start` (the default), a start with `engine.format: auto` whose candidates
(`formats.auto_candidates`, those this device can run) lack a stored gate result for this model does
not wait for them: it serves at once (bootstrap.py) and the stage runs this module as a child process
at the lowest CPU priority (background.py). The child converts each such candidate from the float32
reference, scores it over the prompts of gate_prompts.json (quality.evaluate), adds the results to the
model's file under var/gate/ (the file `make gate` writes), then chooses among every candidate as a
start would (selection.choose_auto). A failing candidate is stored too, so a later start finds every
candidate gated and runs nothing.

Protocol: `python -m services.inference.formats.startgate STAGE_PID`, the job (a `GateJob`, JSON)
on stdin; on stdout one JSON line per scored prompt,
{"done": n, "total": N}, then one {"choice": format or null, "reason": why}. Logs go to stderr as JSON.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from services.inference.formats import gateprompts, quality
from services.inference.formats.quality import GateThresholds
from services.inference.formats.selection import REFERENCE, FormatsConfig, choose_auto, gate_path
from services.inference.model.loader import check_format, load_model, model_in_format
from shared import parentdeath
from shared.config import ConfigError
from shared.errors import InvalidInput

log = logging.getLogger(__name__)
NICE = 19  # the child's CPU priority: serving requests always comes first


@dataclass(frozen=True)
class GateJob:
    """What the child gates and how it then chooses, as the stage's config says."""

    model_dir: str
    model_sha: str
    formats: tuple[str, ...]  # the candidates to gate (pending())
    config: FormatsConfig
    device: str
    threads: int              # the stage's torch threads, so that choose_auto times formats as they run
    max_batch: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> GateJob:
        d = json.loads(text)
        c = d["config"]
        config = FormatsConfig(gate=GateThresholds(**c["gate"]), force=c["force"],
                               auto_candidates=tuple(c["auto_candidates"]), gate_at_start=c["gate_at_start"],
                               gate_prompts=c["gate_prompts"])
        return GateJob(d["model_dir"], d["model_sha"], tuple(d["formats"]), config, d["device"], d["threads"],
                       d["max_batch"])


@dataclass(frozen=True)
class Verdict:
    """The child's last line: the format `auto` chooses now (None: none eligible) and why."""

    choice: str | None
    reason: str


def pending(cfg: FormatsConfig, model_sha: str, device: str, model_dir: Path) -> tuple[str, ...]:
    """The auto candidates this device can run on this model that have no stored gate result for it."""
    stored = quality.load(gate_path(model_sha), model_sha)

    def runs_here(format: str) -> bool:
        try:
            check_format(format, device, model_dir=model_dir)
            return True
        except InvalidInput:
            return False
    return tuple(f for f in cfg.auto_candidates if f != REFERENCE and f not in stored and runs_here(f))


def writable(model_sha: str) -> bool:
    """Whether gate results can be stored (not a read-only var/): else a gate run is lost work."""
    path = gate_path(model_sha)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        log.warning("quality gate not run at start: its results could not be stored", extra={"error": str(exc)})
        return False
    return True


def run(job: GateJob, progress: Callable[[int, int], None]) -> Verdict:
    """Gate `job.formats` against the float32 reference, store the results, then choose."""
    cfg, sha = job.config, job.model_sha
    model_dir = Path(job.model_dir)
    sequences = gateprompts.load(cfg.gate_prompts)
    reference = load_model(model_dir, REFERENCE, job.device)
    log.info("running the quality gate (no stored result for these formats)",
             extra={"formats": list(job.formats), "prompts": len(sequences)})
    t0 = time.perf_counter()
    candidates = {f: model_in_format(reference, f, model_dir, job.device) for f in job.formats}
    results = quality.evaluate(reference, candidates, sequences, progress=lambda done: progress(done, len(sequences)))
    path = gate_path(sha)
    stored = quality.load(path, sha)
    quality.store(path, sha, [*(r for f, r in stored.items() if f not in job.formats), *results],
                  gateprompts.describe(len(sequences)))
    verdicts = {r.format: "fails: " + "; ".join(r.failures(cfg.gate)) if r.failures(cfg.gate) else "passes"
                for r in results}
    log.info("quality gate run", extra={
        "seconds": round(time.perf_counter() - t0, 1), "stored": str(path), "verdicts": verdicts,
        "results": {r.format: {"kl_mean": r.kl_mean, "kl_p95": r.kl_p95, "greedy_agreement": r.greedy_agreement}
                    for r in results}})
    try:
        choice, _ = choose_auto(reference, sha, cfg, job.max_batch, job.device, model_dir)
    except ConfigError as exc:  # nothing eligible: the stage keeps what it serves
        return Verdict(None, str(exc))
    return Verdict(choice.format, choice.reason)


def main() -> int:
    from services.inference.engine.warmup import set_deterministic
    from shared.logging import setup_logging

    setup_logging("inference")
    # SIGKILL, not SIGTERM: the stage stops this process while it serves requests (background.py),
    # and a stopped process acts on no other signal; it has nothing to drain either
    if not parentdeath.arm(signal.SIGKILL, int(sys.argv[1])):
        log.warning("the stage that started this gate is gone; not gating")
        return 1
    os.nice(NICE)
    job = GateJob.from_json(sys.stdin.read())
    torch.set_num_threads(job.threads)
    set_deterministic(job.device)

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
    verdict = run(job, lambda done, total: emit({"done": done, "total": total}))
    emit(asdict(verdict))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
