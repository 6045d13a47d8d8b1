"""Assembles the tokenizer stage: map the compiled vocabulary, self-check, serve.

Several worker processes (config/keel.yaml `workers`) bind the same port with SO_REUSEPORT and
map the same file: the tables are shared pages. Readiness = file mapped + self-check + warm-up.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from keel.tokenizer.v1 import tokenizer_pb2_grpc
from services.tokenizer import config as tok_config
from services.tokenizer.core import Tokenizer
from services.tokenizer.servicer import TokenizerServicer
from shared import metrics
from shared.config import ROOT_DIR, ServerConfig
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
        path = Path(self.cfg.vocab_file)
        tok = await asyncio.to_thread(Tokenizer.open, path if path.is_absolute() else ROOT_DIR / path)
        await asyncio.to_thread(tok.self_check)
        await asyncio.to_thread(tok.warmup)
        self.servicer.tok = tok  # until now the interceptor answered UNAVAILABLE (not ready)

    async def close(self) -> None:
        return None


def build() -> tuple[TokenizerStage, ServerConfig]:
    cfg = tok_config.load()
    return TokenizerStage(cfg), cfg.server
