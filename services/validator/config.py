"""The validator stage's one typed config object (config/validator.yaml, schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from services.validator.quarantine import QuarantineConfig
from shared import config
from shared.config import ROOT_DIR, ServerConfig


@dataclass(frozen=True)
class ValidatorConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    contracts_dir: str = "config/contracts"
    pipeline_file: str = "config/validator/pipeline.yaml"
    quarantine: QuarantineConfig = field(default_factory=QuarantineConfig)
    metrics_window_s: float = 300.0
    # CPU time one input check may use before the input is refused (INPUT_CHECK_BUDGET_EXCEEDED).
    input_cpu_budget_ms: float = 250.0

    def path(self, value: str | Path) -> Path:
        p = Path(value)
        return p if p.is_absolute() else ROOT_DIR / p


def load(path=None, environ=None) -> ValidatorConfig:
    cfg = config.load("validator", ValidatorConfig, path, environ)
    return replace(cfg, quarantine=replace(cfg.quarantine, spill_path=cfg.path(cfg.quarantine.spill_path)))
