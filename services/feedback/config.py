"""The feedback stage's one typed config object (config/feedback.yaml, schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from shared import config
from shared.config import ROOT_DIR, VAR_DIR, ServerConfig

ERROR_TYPES = ("fact_error", "logic_error", "format_error", "irrelevant")
SEVERITIES = ("minor", "moderate", "severe")


@dataclass(frozen=True)
class DatabaseConfig:
    # SQLAlchemy URL; "" = embedded SQLite (WAL) at <KEEL_VAR_DIR>/feedback/feedback.db.
    # PostgreSQL: postgresql+psycopg://user:password@host:5432/keel
    url: str = ""
    connect_timeout_s: int = 2
    pool_size: int = 5


@dataclass(frozen=True)
class ReplayConfig:
    # False keeps only the hashes of prompts and answers; `keel replay` then cannot run.
    store_prompts: bool = True
    retention_days: int = 30
    # Records the database could not take wait here (fsync'd) until it is back; "" = under KEEL_VAR_DIR.
    spill_path: str = ""
    probe_interval_s: float = 0.5
    replay_batch: int = 500


@dataclass(frozen=True)
class SubmitConfig:
    # Feedback items written per transaction at most (group commit: services/feedback/batcher.py).
    max_batch: int = 256
    # Items waiting for a transaction; beyond it new Submit calls wait for room.
    queue_size: int = 4096


@dataclass(frozen=True)
class EtlConfig:
    severities: tuple[str, ...] = ("severe",)
    error_types: tuple[str, ...] = ("fact_error",)
    val_percent: int = 10  # share of items in the validation split, by a hash of the input fingerprint
    seed: int = 20240601


ROTATION_ACTIONS = ("switch_variant", "retrain_adapters", "resample_data")


@dataclass(frozen=True)
class RetryConfig:
    attempts: int = 3              # tries of one action before it is recorded as failed
    initial_backoff_s: float = 0.5  # doubled after each failed try, up to max_backoff_s
    max_backoff_s: float = 10.0


@dataclass(frozen=True)
class CooldownConfig:
    # One field per action in ROTATION_ACTIONS (seconds).
    switch_variant: float = 3600.0
    retrain_adapters: float = 86400.0
    resample_data: float = 86400.0


@dataclass(frozen=True)
class ResampleConfig:
    since: str = "14d"        # the feedback window of the ETL run (a duration: 24h, 7d)
    out_dir: str = ""         # datasets go to <out_dir>/rotation-<decision id>; "" = KEEL_VAR_DIR/datasets


class Mode(StrEnum):
    """What the rotation executor does with an alert: record it for approval, or act at once."""

    PROPOSE = "propose"
    APPLY = "apply"


@dataclass(frozen=True)
class RotationConfig:
    # propose: record what an alert asks for and apply nothing until `keel rotation approve ID`;
    # apply: act at once. Every decision is recorded either way (docs/rotation.md).
    mode: str = Mode.PROPOSE  # the schema allows exactly Mode's values
    # Alertmanager's webhook receiver (HTTP, Authorization: Bearer <mesh token>); port 0 = off.
    # The port: config/keel.yaml's `webhook_ports` unless set.
    webhook_host: str = "127.0.0.1"
    webhook_port: int = 0
    # The inference replicas a variant switch goes to (every one, or none: never half of them);
    # config/keel.yaml's unless set.
    inference: tuple[str, ...] = ()
    primary_variant: str = "primary"   # what a resolved switch_variant alert switches back to
    call_timeout_s: float = 10.0
    # After an action was applied or proposed, a new alert asking for the same action within this
    # many seconds is recorded as "cooldown" and does nothing.
    cooldown_s: CooldownConfig = field(default_factory=CooldownConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    resample: ResampleConfig = field(default_factory=ResampleConfig)

    @property
    def resample_dir(self) -> Path:
        p = Path(self.resample.out_dir) if self.resample.out_dir else VAR_DIR / "datasets"
        return p if p.is_absolute() else ROOT_DIR / p


@dataclass(frozen=True)
class FeedbackConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    etl: EtlConfig = field(default_factory=EtlConfig)
    rotation: RotationConfig = field(default_factory=RotationConfig)

    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{VAR_DIR / 'feedback' / 'feedback.db'}"

    @property
    def spill_path(self) -> Path:
        p = Path(self.replay.spill_path) if self.replay.spill_path else VAR_DIR / "feedback" / "records.spill"
        return p if p.is_absolute() else ROOT_DIR / p


def load(path=None, environ=None) -> FeedbackConfig:
    cfg = config.load("feedback", FeedbackConfig, path, environ, upstreams={("rotation", "inference"): "inference"})
    return replace(cfg, etl=replace(cfg.etl, severities=tuple(cfg.etl.severities),
                                    error_types=tuple(cfg.etl.error_types)),
                   rotation=replace(cfg.rotation, inference=tuple(cfg.rotation.inference)))
