"""Gateway stage. Run: python -m services.gateway   (config/gateway.yaml; KEEL_GATEWAY_* overrides)"""
from services.gateway.server import build
from shared.server import run

run("gateway", build)
