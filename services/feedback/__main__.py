"""Feedback stage. Run: python -m services.feedback   (config/feedback.yaml; KEEL_FEEDBACK_* overrides)"""
from services.feedback.server import build
from shared.server import run

run("feedback", build)
