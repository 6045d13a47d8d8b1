"""keel-client as a client team gets it: its wheel built from clients/python, used from a Python
that sees only the wheel and its three dependencies (no Keel code, no generated stubs of the
repository, no .pth files), against the real gateway."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from keelctl.ask import DEV_API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import asyncio, json, sys
    from keel_client import AsyncClient, Client, Delta, errors
    target, key = sys.argv[1], sys.argv[2]
    out = {}
    with Client(target, api_key=key, timeout=120) as keel:
        a = keel.generate("What is the capital of France?", max_tokens=8, seed=3)
        out["answer"] = [a.text, a.trace_id, a.finish_reason, a.completion_tokens, a.system_fingerprint]
        s = keel.stream(messages=[("user", "Say hello.")], max_tokens=6, seed=3)
        events = list(s)
        out["stream"] = [s.trace_id, [type(e).__name__ for e in events], events[-1].trace_id,
                         "".join(e.text for e in events if isinstance(e, Delta)) == events[-1].text]
        try:
            keel.generate("   ")
        except errors.InvalidRequest as e:
            out["error"] = [type(e).__name__, e.code, e.reason, len(e.trace_id)]
    with Client(target, api_key="wrong-key") as bad:
        try:
            bad.generate("hi")
        except errors.AuthenticationError as e:
            out["auth"] = e.reason

    async def main():
        async with AsyncClient(target, api_key=key, timeout=120) as keel:
            a = await keel.generate("What is the capital of France?", max_tokens=8, seed=3)
            s = await keel.stream("What is the capital of France?", max_tokens=8, seed=3)
            events = [e async for e in s]
            return [a.text, s.trace_id == events[-1].trace_id, events[-1].text]
    out["async"] = asyncio.run(main())
    out["modules"] = sorted(m for m in ("torch", "shared", "services", "transformers") if m in sys.modules)
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT / "clients/python"), "-w", str(out)], check=True, timeout=300)
    (whl,) = out.glob("keel_client-*.whl")
    return whl


def test_the_wheel_depends_on_grpc_and_protobuf_only(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
        names = z.namelist()
    requires = sorted(re.split(r"[<>=!~ ;]", line.split(":", 1)[1].strip())[0]
                      for line in meta.splitlines() if line.startswith("Requires-Dist:"))
    assert requires == ["googleapis-common-protos", "grpcio", "protobuf"]
    assert "keel/gateway/v1/gateway_pb2_grpc.py" in names and "keel_client/client.py" in names


def test_the_wheel_alone_talks_to_the_real_gateway(wheel, mesh, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site processing, so neither the editable Keel install nor gen/ (both .pth files) is
    # importable; the venv's site-packages provides only grpcio, protobuf and googleapis-common-protos.
    env = {"PYTHONPATH": f"{site}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", "-c", SCRIPT, mesh.gateway, DEV_API_KEY], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    text, trace_id, finish, tokens, fingerprint = out["answer"]
    assert text and len(trace_id) == 32 and finish in ("stop", "length") and 0 < tokens <= 8
    assert len(fingerprint) == 16
    stream_trace, kinds, final_trace, joined = out["stream"]
    assert kinds[-1] == "Answer" and set(kinds[:-1]) <= {"Delta"} and stream_trace == final_trace
    assert out["error"] == ["InvalidRequest", "INVALID_ARGUMENT", "EMPTY_PROMPT", 32]
    assert out["auth"] == "INVALID_API_KEY"
    assert out["async"][0] == text and out["async"][1] and out["async"][2] == text
    assert out["modules"] == []
