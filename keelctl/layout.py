"""The mesh layout (config/keel.yaml) and where each process of it listens."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from shared import config
from shared.config import VAR_DIR  # tests point KEEL_VAR_DIR at a temporary folder
from shared.topology import LOOPBACK

ROOT = Path(__file__).resolve().parent.parent
RUN_DIR = VAR_DIR / "run"
LOG_DIR = VAR_DIR / "log"
STATE_FILE = RUN_DIR / "keel.json"


@dataclass(frozen=True)
class RedisLayout:
    port: int = 6390
    dir: str = "var/redis"
    # Redis's memory cap. Its policy is always noeviction: the quarantine must never be evicted, so
    # at the cap writes fail (the validator spills to its local file) and an alert fires before.
    maxmemory_mb: int = 256


@dataclass(frozen=True)
class StageLayout:
    ports: tuple[int, ...] = ()
    metrics_ports: tuple[int, ...] = ()
    webhook_ports: tuple[int, ...] = ()  # the feedback stage's rotation webhook, per replica
    workers: int = 1


@dataclass(frozen=True)
class StagesLayout:
    tokenizer: StageLayout = field(default_factory=StageLayout)
    inference: StageLayout = field(default_factory=StageLayout)
    validator: StageLayout = field(default_factory=StageLayout)
    feedback: StageLayout = field(default_factory=StageLayout)  # no ports: no feedback stage
    gateway: StageLayout = field(default_factory=StageLayout)
    openai: StageLayout = field(default_factory=StageLayout)  # no ports: no OpenAI-compatible API


@dataclass(frozen=True)
class RestartPolicy:
    """How long the supervisor waits before restarting a dead child (keelctl/supervisor.py)."""

    initial_backoff_s: float = 0.2
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    # deaths after SERVING within stable_after_s that are restarted at initial_backoff_s; past
    # them the child counts as crash-looping and each wait doubles
    burst: int = 10


@dataclass(frozen=True)
class ModelLayout:
    """The served model's block (shared/modelfile.py reads it; KEEL_MODEL overrides it)."""

    path: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Layout:
    model: ModelLayout = field(default_factory=ModelLayout)
    redis: RedisLayout = field(default_factory=RedisLayout)
    stages: StagesLayout = field(default_factory=StagesLayout)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    ready_timeout_s: float = 600.0  # the inference stage's first start may run the quality gate
    metrics_port: int = 0

    def stage(self, name: str) -> StageLayout:
        return getattr(self.stages, name)

    def targets(self, name: str) -> list[str]:
        return [f"{LOOPBACK}:{p}" for p in self.stage(name).ports]


def load_layout(path: Path | None = None) -> Layout:
    return config.load("keel", Layout, path)


def read_state() -> dict:
    """What a running supervisor wrote: its pid, the mesh token, every process and port."""
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def write_state(state: dict) -> None:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the mesh token
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, STATE_FILE)
