"""Assembles the tokenizer stage: map the compiled vocabulary, self-check, serve.

Several worker processes (config/keel.yaml `workers`) bind the same port with SO_REUSEPORT and
map the same file: the tables are shared pages. Readiness = file mapped + self-check + warm-up.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc

from keel.tokenizer.v1 import tokenizer_pb2_grpc
from services.tokenizer import config as tok_config
from services.tokenizer.compiler import compile_vocab, compiled_path
from services.tokenizer.core import Tokenizer
from services.tokenizer.servicer import TokenizerServicer
from shared import metrics, modelcard, modelfile
from shared.config import ROOT_DIR, ConfigError, ServerConfig
from shared.errors import PreconditionFailed
from shared.stages import SERVICE_NAMES


class TokenizerStage:
    name = "tokenizer"
    service_name = SERVICE_NAMES["tokenizer"]

    def __init__(self, cfg: tok_config.TokenizerConfig):
        self.cfg = cfg
        self.servicer = TokenizerServicer(cfg, metrics.metrics_for("tokenizer"))

    def register(self, server: grpc.aio.Server) -> None:
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(self.servicer, server)

    async def warmup(self) -> None:
        tok = await asyncio.to_thread(Tokenizer.open, Path(self.cfg.vocab_file))
        await asyncio.to_thread(tok.self_check)
        await asyncio.to_thread(tok.warmup)
        pad = tok.pad_token_id if self.cfg.pad_token_id is None else self.cfg.pad_token_id
        if pad >= tok.vocab_size:
            raise ConfigError(f"field 'pad_token_id' breaks rule 'vocabulary': the model has {tok.vocab_size} tokens")
        self.servicer.tok = tok  # until now the interceptor answered UNAVAILABLE (not ready)

    async def close(self) -> None:
        return None


def with_model(cfg: tok_config.TokenizerConfig, source: modelfile.ModelSource) -> tok_config.TokenizerConfig:
    """`cfg` for `source`: its compiled vocabulary (compiled now when missing or stale) and its context."""
    card = modelcard.read(source)
    if cfg.max_length is not None and cfg.max_length > card.context_tokens:
        raise ConfigError(f"field 'max_length' breaks rule 'at most the model's context ({card.context_tokens})'")
    if cfg.vocab_file:
        path = Path(cfg.vocab_file)
        vocab = path if path.is_absolute() else ROOT_DIR / path
    else:
        try:
            vocab = compile_vocab(source.path, compiled_path(source))
        except PreconditionFailed as exc:  # a tokenizer Keel does not implement
            raise ConfigError(f"field 'model.path' breaks rule 'tokenizer': {exc}") from exc
    return replace(cfg, vocab_file=str(vocab), max_length=cfg.max_length or card.context_tokens)


def build() -> tuple[TokenizerStage, ServerConfig]:
    cfg = with_model(tok_config.load(), modelfile.source())
    return TokenizerStage(cfg), cfg.server
