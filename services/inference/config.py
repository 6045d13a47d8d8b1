"""The inference stage's one typed config object (config/inference.yaml, schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.inference.engine.core import EngineConfig
from services.inference.formats.selection import FormatsConfig
from services.inference.lora.registry import LoraConfig
from shared import config
from shared.config import ROOT_DIR, ServerConfig


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model_path: str = "var/model"
    engine: EngineConfig
    formats: FormatsConfig = field(default_factory=FormatsConfig)
    warm_restart: bool = True  # reuse the calibration stored under var/warm by an identical engine
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def model_dir(self) -> Path:
        p = Path(self.model_path)
        return p if p.is_absolute() else ROOT_DIR / p


def load(path=None, environ=None) -> InferenceConfig:
    return config.load("inference", InferenceConfig, path, environ)
