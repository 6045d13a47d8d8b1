"""Tokenizer stage. Run: python -m services.tokenizer   (config/tokenizer.yaml; KEEL_TOKENIZER_* overrides)"""
from services.tokenizer.server import build
from shared.server import run

run("tokenizer", build)
