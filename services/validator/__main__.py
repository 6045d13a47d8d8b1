"""Validator stage. Run: python -m services.validator   (config/validator.yaml; KEEL_VALIDATOR_* overrides)"""
from services.validator.server import build
from shared.server import run

run("validator", build)
