"""The inference stage's one typed config object (config/inference.yaml, schema-validated).

Each field's bounds are config/schemas/inference.schema.json's, checked when the file is loaded; the
dataclasses below check only what the schema cannot say (rules between fields, a format the device runs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.inference.engine.core import EngineConfig
from services.inference.formats.selection import FormatsConfig
from services.inference.lora.registry import LoraConfig
from shared import config, modelfile
from shared.config import ROOT_DIR, ServerConfig


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # The prepared model folder (model/modelcache.py); empty: the served model's (shared/modelfile.py),
    # which the stage prepares at start. Set only by code that serves another folder (tests, tools).
    model_path: str = ""
    engine: EngineConfig
    formats: FormatsConfig = field(default_factory=FormatsConfig)
    warm_restart: bool = True  # reuse the calibration stored under var/warm by an identical engine
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def model_dir(self) -> Path:
        """The prepared folder: model_path's, or the served model's (prepared now if it is not yet)."""
        if not self.model_path:
            from services.inference.model import modelcache

            return modelcache.prepared(modelfile.source())
        p = Path(self.model_path)
        return p if p.is_absolute() else ROOT_DIR / p


def load(path=None, environ=None) -> InferenceConfig:
    return config.load("inference", InferenceConfig, path, environ)
