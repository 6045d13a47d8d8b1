"""The tokenizer stage's one typed config object (config/tokenizer.yaml, schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import config
from shared.config import ServerConfig
from shared.stages import CONTEXT_TOKENS


@dataclass(frozen=True)
class TokenizerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    vocab_file: str = "var/vocab.kvoc"
    max_input_bytes: int = 1_000_000
    max_length: int = CONTEXT_TOKENS  # truncation when a request names no max_length (shared/stages.py)
    pad_token_id: int = 2
    padding_side: str = "left"
    truncation_side: str = "left"
    offload_bytes: int = 4096


def load(path=None, environ=None) -> TokenizerConfig:
    return config.load("tokenizer", TokenizerConfig, path, environ)
