"""`keel up --model` on a model a team brings: a tiny random-weight model (testing/tinymodels.py, Q8_0
GGUF with SmolLM2's tokenizer: llama, and qwen3, the layer furthest from it; and one Hugging Face
folder, the qwen2 one with SmolLM2's tokenizer files) answers through the gateway and the OpenAI front
under its own name, `keel replay` reproduces an answer bit for bit, `keel status` names it, and a LoRA
adapter registered against the shipped SmolLM2 is refused on it with BASE_FINGERPRINT_MISMATCH. The
mesh path is the same for every architecture; llama3, the qwen2 GGUF and mistral are checked where
they differ, at the model (tests/inference/test_architectures.py: logits against transformers and
llama.cpp)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request

import grpc
import jsonschema
import pytest

from keelctl.ask import DEV_API_KEY, build_request
from services.inference.model.loader import load_model
from services.inference.model.modelcache import prepared
from testing.lora import make_adapter
from testing.mesh import ROOT, start_mesh, stop_mesh, wait_until
from testing.tinymodels import SPECS, tiny_model_files
from tests.e2e.conftest import error_info
from tests.e2e.test_cli import keel
from tests.e2e.test_feedback import store

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

ADAPTER = "smol-only"


@pytest.fixture(scope="module")
def smollm2_registry(tmp_path_factory):
    """A registry holding one adapter registered (`keel lora register`) against the shipped SmolLM2."""
    tmp = tmp_path_factory.mktemp("registry")
    folder = make_adapter(load_model(prepared(), "float32"), tmp / ADAPTER, seed=3)
    env = {k: v for k, v in os.environ.items() if k not in ("KEEL_MODEL", "KEEL_MODEL_NAME")}
    out = subprocess.run([sys.executable, "-m", "keelctl", "lora", "register", str(folder), "--id", ADAPTER,
                          "--version", "1"], cwd=ROOT, env={**env, "KEEL_VAR_DIR": str(tmp / "var")},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp / "var" / "adapters"


FOLDER = "qwen2-folder"  # the one Hugging Face folder among the models
MESHES = ("llama", "qwen3", FOLDER)  # one mesh each (a mesh costs ~40 s of the suite)


QWEN_TEMPLATE = ROOT / "tests" / "tokenizer" / "fixtures" / "qwen2.5-instruct.jinja"
TRIP = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]}}, "required": ["city"]}


def folder_model(tmp) -> str:
    """The tiny qwen2's transformers folder with the shipped model's tokenizer files beside its weights,
    its chat template Qwen2.5-Instruct's (which has a tools section: tool calls in its own format)."""
    folder = tmp / "qwen2-hf"
    shutil.copytree(tiny_model_files("qwen2", "Q8_0").hf, folder)
    shutil.copy(prepared() / "hf-tokenizer" / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((prepared() / "hf-tokenizer" / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module", params=MESHES)
def team_mesh(request, tmp_path_factory, smollm2_registry):
    name = request.param
    tmp = tmp_path_factory.mktemp(f"model-{name}")
    shutil.copytree(smollm2_registry, tmp / "var" / "adapters")
    path = folder_model(tmp) if name == FOLDER else str(tiny_model_files(name, "Q8_0").gguf)
    mesh = start_mesh(tmp, extra_env={"KEEL_MODEL": path, "KEEL_MODEL_NAME": f"team-{name}"})
    mesh.arch, mesh.folder = name.removesuffix("-folder"), name == FOLDER
    yield mesh
    stop_mesh(mesh)


def ask(mesh, **kw):
    with grpc.insecure_channel(mesh.gateway) as ch:
        return mesh.stub(ch).Generate(build_request("Tell me a story.", max_tokens=12, temperature=0.0, **kw),
                                      metadata=(("x-api-key", DEV_API_KEY),), timeout=120)


def http(mesh, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(f"http://{mesh.http}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {DEV_API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_the_model_answers_through_the_gateway_and_replays_identically(team_mesh):
    answer = ask(team_mesh)
    assert answer.usage.completion_tokens > 0 and answer.usage.prompt_tokens > 0
    record = wait_until(lambda: store(team_mesh).get_record(answer.trace_id), 30, "the replay record")
    assert len(record.output_ids) == answer.usage.completion_tokens
    out = keel(team_mesh, "replay", answer.trace_id)
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr


def test_the_openai_front_serves_it_under_its_own_name(team_mesh):
    name = f"team-{team_mesh.arch}" + ("-folder" if team_mesh.folder else "")
    assert [m["id"] for m in http(team_mesh, "/v1/models")["data"]][0] == name
    r = http(team_mesh, "/v1/chat/completions", {"model": name, "max_tokens": 6, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert r["model"] == name and r["usage"]["completion_tokens"] > 0
    assert http(team_mesh, "/tokenize", {"model": name, "prompt": "hi"})["max_model_len"] == 512


def test_keel_status_names_the_model_and_its_family(team_mesh):
    out = keel(team_mesh, "status")
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("model "))
    assert f"team-{team_mesh.arch}" in line and SPECS[team_mesh.arch].get("arch", "llama") in line
    assert "context 512" in line and ("float32" if team_mesh.folder else "Q8_0") in line
    assert re.search(r"inference@127\.0\.0\.1:\d+ serves it in float32 \(variant primary\)", out.stdout)


def test_an_adapter_registered_against_smollm2_is_refused_with_its_reason(team_mesh):
    with pytest.raises(grpc.RpcError) as exc:
        ask(team_mesh, adapter=ADAPTER)
    info = error_info(exc.value)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and info.reason == "ADAPTER_REFUSED"
    assert info.metadata["refusal_reason"] == "BASE_FINGERPRINT_MISMATCH"


def test_a_templates_own_tool_format_serves_a_forced_call_and_replays_it(team_mesh):
    """The folder model's template is Qwen2.5's: the tools go into its tools section (/tokenize counts
    them), a forced call is decoded in its <tool_call> format, parses and validates, and `keel replay`
    renders the recorded tools again and reproduces the call's tokens."""
    if not team_mesh.folder:
        pytest.skip("only the folder model has a template with a tools section")
    name = "team-qwen2-folder"
    tool = {"type": "function", "function": {"name": "trip", "description": "Book a trip", "parameters": TRIP}}
    chat = [{"role": "user", "content": "Book me a trip"}]
    plain = http(team_mesh, "/tokenize", {"model": name, "messages": chat})["count"]
    assert http(team_mesh, "/tokenize", {"model": name, "messages": chat, "tools": [tool]})["count"] > plain + 20
    r = http(team_mesh, "/v1/chat/completions", {"model": name, "max_tokens": 96, "temperature": 0, "messages": chat,
                                                 "tools": [tool], "tool_choice": "required"})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "trip"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TRIP)
    trace_id = r["id"].removeprefix("chatcmpl-")
    wait_until(lambda: store(team_mesh).get_record(trace_id), 30, "the replay record")
    out = keel(team_mesh, "replay", trace_id)
    assert out.returncode == 0 and out.stdout.startswith("identical"), out.stdout + out.stderr
