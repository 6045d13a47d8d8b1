"""Fixtures shared by every test folder: protobuf request builders (free ports: testing/ports.py);
every test under tests/e2e is marked `e2e` (`make test-fast` leaves them out)."""
from __future__ import annotations

from pathlib import Path

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2

E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items):
    for item in items:
        if E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def gateway_request():
    """Builds a Gateway GenerateRequest: gateway_request("hi", max_tokens=8) or messages=[(role, text)]."""
    def build(prompt: str | None = None, *, messages=None, max_tokens: int = 16, temperature: float = 0.0,
              seed: int | None = None, domain: str = "", source: str = "") -> gateway_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
        if seed is not None:
            sampling.seed = seed
        req = gateway_pb2.GenerateRequest(sampling=sampling, domain=domain, source=source)
        if messages is not None:
            req.chat.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in messages)
        else:
            req.prompt = prompt
        return req
    return build
