"""OpenAI-compatible HTTP stage. Run: python -m services.openai   (config/openai.yaml; KEEL_OPENAI_* overrides)"""
from services.openai.server import run

run()
