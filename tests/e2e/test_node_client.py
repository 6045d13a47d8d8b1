"""A Node client built from the public protos alone (@grpc/grpc-js + @grpc/proto-loader from npm,
tests/node, installed by `make setup`) calls the real gateway: unary, stream, an error's details."""
from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from keelctl.ask import DEV_API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "node"
# googleapis' google/rpc protos, as the googleapis-common-protos package ships them
GOOGLEAPIS = Path(sysconfig.get_paths()["purelib"])


def test_node_client_from_the_protos_alone(mesh):
    node = shutil.which("node")
    assert node, "node is missing: `make setup` installs it (Debian nodejs)"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), "run `make setup` (npm ci in tests/node)"
    done = subprocess.run([node, "call_gateway.js", mesh.gateway, DEV_API_KEY, str(ROOT / "protos"), str(GOOGLEAPIS)],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    unary = out["unary"]
    assert unary["text"] and len(unary["trace_id"]) == 32 and unary["initial_trace_id"] == unary["trace_id"]
    assert unary["finish_reason"] in ("stop", "length")
    kinds = out["stream"]["kinds"]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"delta"}
    assert out["stream"]["deltas"].strip() and out["stream"]["done_text"]
    err = out["error"]
    assert err["code"] == 3  # INVALID_ARGUMENT
    info = err["details"]["google.rpc.ErrorInfo"]
    assert (info["reason"], info["domain"]) == ("TEMPERATURE_OUT_OF_RANGE", "keel.dev")
