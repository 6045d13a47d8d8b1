"""Inference stage. Run: python -m services.inference   (config/inference.yaml; KEEL_INFERENCE_* overrides)"""
from services.inference.server import build
from shared.server import run

run("inference", build)
