"""The e2e tests' fixtures: one session mesh (testing/mesh.py), the LoRA files' mesh, API metadata,
error details."""
from __future__ import annotations

import json

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from keelctl.ask import DEV_API_KEY
from shared.stages import SERVICE_NAMES
from testing.mesh import Mesh, start_mesh, stop_mesh

SERVICES = SERVICE_NAMES


# A second API key with a rate limit of one request (tests/e2e/test_openai.py: a 429 and its hint).
THROTTLED_API_KEY = "keel-throttled-key"
THROTTLED_KEY_HASH = ("sha256$c565d56ff980c45d41de6274d3d1005f$"
                      "506ebf445294c95f80fe59126355dedbc1830f7424fb62dac5557209e26cf4e8")


def throttled_key_env() -> dict[str, str]:
    """Gateway overrides adding the throttled key beside the configured ones."""
    from services.gateway import config as gateway_config
    keys = [{"key_id": k.key_id, "key_hash": k.key_hash} for k in gateway_config.load().api_keys]
    keys.append({"key_id": "throttled", "key_hash": THROTTLED_KEY_HASH})
    return {"KEEL_GATEWAY_API_KEYS": json.dumps(keys),
            "KEEL_GATEWAY_RATE_LIMITS__PER_KEY": json.dumps({"throttled": {"rate_per_s": 0.001, "burst": 1}})}


@pytest.fixture(scope="session")
def mesh(tmp_path_factory) -> Mesh:
    m = start_mesh(tmp_path_factory.mktemp("mesh"), extra_env=throttled_key_env())
    yield m
    stop_mesh(m)


@pytest.fixture(scope="session")
def lora_walk(tmp_path_factory):
    """One mesh for tests/e2e/test_lora_doc_steps.py and tests/e2e/test_lora_mesh.py (a mesh and a
    registration fewer): docs/lora.md's first-adapter block walked on a fresh var/, the LoRA file's
    other adapters registered just before its `keel up`. (mesh, the block's outputs, those registrations)."""
    from tests.e2e.test_lora_doc_steps import walk
    from tests.e2e.test_lora_mesh import register_beside_the_pirate
    yield from walk(tmp_path_factory.mktemp("lora"), register_beside_the_pirate)


@pytest.fixture
def api_md():
    return (("x-api-key", DEV_API_KEY),)


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The google.rpc.ErrorInfo a Keel error carries (fails the test if there is none)."""
    raw = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
    assert raw, f"no rich status on {err.code()}: {err.details()}"
    status = status_pb2.Status.FromString(raw)
    for d in status.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            return info
    raise AssertionError("no ErrorInfo in status details")
