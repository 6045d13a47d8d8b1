"""The tokenizer stage's one typed config object (config/tokenizer.yaml, schema-validated)."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared import config
from shared.config import ServerConfig


@dataclass(frozen=True)
class TokenizerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # The compiled vocabulary every worker mmaps; empty: the served model's, var/models/<key>/vocab.kvoc
    # (shared/modelfile.py), compiled at start when it is missing.
    vocab_file: str = ""
    max_input_bytes: int = 1_000_000
    max_length: int | None = None  # truncation when a request names none; None: the model's context
    pad_token_id: int | None = None  # None: the model's padding token (else its end-of-sequence token)
    padding_side: str = "left"
    truncation_side: str = "left"
    offload_bytes: int = 4096


def load(path=None, environ=None) -> TokenizerConfig:
    return config.load("tokenizer", TokenizerConfig, path, environ)
